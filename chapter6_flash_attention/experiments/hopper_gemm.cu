// Part 3's first program: a bfloat16 GEMM on Hopper's machinery alone (TMA, mbarrier, wgmma,
// warp specialization, setmaxnreg), checked against a reference and timed. It is where a wrong
// descriptor, swizzle or barrier phase shows up in minutes, before attention is built on the same
// wrappers (csrc/hopper/hopper.cuh).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I../csrc -o /tmp/hopper_gemm hopper_gemm.cu
//   /tmp/hopper_gemm            irregular sizes against a CPU reference, 8192^3 against a simple
//                               GPU reference, then the 8192^3 timing (exit 1 on a mismatch)
//
// C (M x N, bfloat16) = A (M x K) B^T, with A and B both K-major (row-major M x K and N x K: the
// layout of Q and K in S = Q K^T), float32 accumulators. With kBTransposed the kernel reads B as a
// K x N row-major matrix instead (the layout of V in O = P V) through a transposed descriptor;
// the check runs both.
//
// The block: 128 x 256 outputs, three warpgroups. Warpgroup 0 is the producer: one thread issues
// the TMA copies of A's 128 x 64 and B's 256 x 64 tiles into a ring of 4 stages, each stage with
// a "full" barrier (the bytes landed) and an "empty" one (all 8 consumer warps finished reading it).
// Warpgroups 1 and 2 are the consumers, 64 rows of C each: wait for a full stage, issue four
// m64n256k16 wgmmas over its 64-wide K slice, and release the *previous* stage once its group
// has completed (one group stays in flight, so the tensor cores never wait for the warps).
// setmaxnreg hands the producer's registers to the consumers, whose accumulators are 128 floats
// a thread. Tiles are visited in groups of 16 block rows so that a wave of blocks reuses A and B
// from the L2 (Triton's grouped ordering).
#include "hopper/hopper.cuh"
#include "hopper/tensor_map.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    cudaError_t err_ = (call);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

using bf16 = __nv_bfloat16;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kThreads = 384;     // producer warpgroup + two consumer warpgroups
constexpr int kGroupRows = 16;    // block rows per group of the grouped tile order
constexpr int kATileBytes = kBM * kBK * 2;
constexpr int kBTileBytes = kBN * kBK * 2;
constexpr int kSmemBytes = kStages * (kATileBytes + kBTileBytes) + 1024;  // + alignment slack

template <bool kBTransposed>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, bf16* c,
                int m, int n, int k) {
#if COURSE_HOPPER_DEVICE
  using namespace hopper;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes and the descriptors assume atoms at that
  // alignment: round the dynamic buffer up to it.
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  unsigned char* a_s = smem;
  unsigned char* b_s = smem + kStages * kATileBytes;
  __shared__ uint64_t full[kStages], empty[kStages];

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);   // the producer's arrive (with the bytes)
      mbarrier_init(&empty[s], 8);  // one arrive per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();  // every thread sees the initialised barriers before it waits on one

  // Grouped tile order: kGroupRows block rows sweep the block columns together.
  const int tiles_m = (m + kBM - 1) / kBM, tiles_n = (n + kBN - 1) / kBN;
  const int per_group = kGroupRows * tiles_n;
  const int group = blockIdx.x / per_group;
  const int first_m = group * kGroupRows;
  const int rows_in_group = min(tiles_m - first_m, kGroupRows);
  const int tile_m = first_m + (blockIdx.x % per_group) % rows_in_group;
  const int tile_n = (blockIdx.x % per_group) / rows_in_group;
  const int k_tiles = (k + kBK - 1) / kBK;

  if (warpgroup == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        // Trip kt / kStages around the ring: wait until both consumers released this stage's
        // previous contents (the first trip finds every stage free).
        if (kt >= kStages) mbarrier_wait(&empty[s], ((kt / kStages) - 1) & 1);
        mbarrier_arrive_expect_tx(&full[s], kATileBytes + kBTileBytes);
        tma_load_2d(a_s + s * kATileBytes, &map_a, &full[s], kt * kBK, tile_m * kBM);
        if constexpr (kBTransposed) {
          // B is K x N: four 64-column chunks of 64 rows of K, stacked (the MN-major layout).
          for (int c = 0; c < kBN / 64; ++c) {
            tma_load_2d(b_s + s * kBTileBytes + c * kBK * 128, &map_b, &full[s], tile_n * kBN + c * 64, kt * kBK);
          }
        } else {
          tma_load_2d(b_s + s * kBTileBytes, &map_b, &full[s], kt * kBK, tile_n * kBN);
        }
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int consumer = warpgroup - 1;  // rows 64 * consumer .. + 63 of the block's tile
  float acc[kBN / 2];
#pragma unroll
  for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.f;
  // The accumulators are fenced only before the first product and after the last wait: an
  // ordinary instruction "defining" them while a group is in flight makes ptxas serialize every
  // wgmma (warning C7515), and consecutive groups into the same registers need nothing between.
  fence_operands(acc);

  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % kStages;
    mbarrier_wait(&full[s], (kt / kStages) & 1);
    const unsigned char* a_tile = a_s + s * kATileBytes + consumer * 64 * 128;
    const unsigned char* b_tile = b_s + s * kBTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const uint64_t da = smem_desc_sw128(a_tile + kk * 32, 16, 1024);
      if constexpr (kBTransposed) {
        // Rows 16kk..16kk+15 of K: 16 rows of 128 bytes further; chunks of 64 columns kBK rows apart.
        const uint64_t db = smem_desc_sw128(b_tile + kk * 16 * 128, kBK * 128, 1024);
        Wgmma<bf16, kBN>::ss<1>(acc, da, db, 1);
      } else {
        const uint64_t db = smem_desc_sw128(b_tile + kk * 32, 16, 1024);
        Wgmma<bf16, kBN>::ss(acc, da, db, 1);
      }
    }
    wgmma_commit();
    // One group may stay in flight: the previous one has now completed, so its stage is free.
    wgmma_wait<1>();
    if (kt > 0 && threadIdx.x % 32 == 0) mbarrier_arrive(&empty[(kt - 1) % kStages]);
  }
  wgmma_wait<0>();
  fence_operands(acc);

  // Epilogue: straight from the accumulators, two bfloat16 (4 bytes) per lane per n8 column tile.
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kBN / 2; i += 2) {
    const int row = tile_m * kBM + consumer * 64 + warp * 16 + g + 8 * ((i >> 1) & 1);
    const int col = tile_n * kBN + 8 * (i >> 2) + 2 * t;
    if (row < m && col < n) {
      // Two bfloat16 at once only where the pair is 4-byte aligned (n odd shifts every other row).
      if (col + 1 < n && (static_cast<int64_t>(row) * n + col) % 2 == 0) {
        *reinterpret_cast<__nv_bfloat162*>(c + static_cast<int64_t>(row) * n + col) =
            __floats2bfloat162_rn(acc[i], acc[i + 1]);
      } else {
        c[static_cast<int64_t>(row) * n + col] = __float2bfloat16(acc[i]);
        if (col + 1 < n) c[static_cast<int64_t>(row) * n + col + 1] = __float2bfloat16(acc[i + 1]);
      }
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------
// Host: references, checks, timing
// ------------------------------------------------------------------------------------------
// The simplest correct GPU GEMM, float32 accumulation in the same order for every output: the
// reference at sizes where the CPU would take minutes.
__global__ void reference_kernel(const bf16* a, const bf16* b, float* c, int m, int n, int k, bool b_transposed) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x, row = blockIdx.y;
  if (col >= n) return;
  float sum = 0.f;
  for (int i = 0; i < k; ++i) {
    const float bv = b_transposed ? __bfloat162float(b[static_cast<int64_t>(i) * n + col])
                                  : __bfloat162float(b[static_cast<int64_t>(col) * k + i]);
    sum += __bfloat162float(a[static_cast<int64_t>(row) * k + i]) * bv;
  }
  c[static_cast<int64_t>(row) * n + col] = sum;
}

struct Problem {
  int m, n, k;
  bool b_transposed;
};

// The tensor maps: A is M x K (K contiguous), B is N x K or, transposed, K x N. Boxes of 64
// contiguous elements (128 bytes, the swizzle's width) by the tile's rows.
static void make_maps(const Problem& pr, const bf16* a, const bf16* b, CUtensorMap* ma, CUtensorMap* mb) {
  const uint64_t a_dims[2] = {static_cast<uint64_t>(pr.k), static_cast<uint64_t>(pr.m)};
  const uint64_t a_strides[1] = {static_cast<uint64_t>(pr.k) * 2};
  const uint32_t a_box[2] = {64, kBM};
  CHECK_CUDA(hopper::make_tensor_map_16bit(ma, a, 2, a_dims, a_strides, a_box));
  if (pr.b_transposed) {
    const uint64_t b_dims[2] = {static_cast<uint64_t>(pr.n), static_cast<uint64_t>(pr.k)};
    const uint64_t b_strides[1] = {static_cast<uint64_t>(pr.n) * 2};
    const uint32_t b_box[2] = {64, kBK};
    CHECK_CUDA(hopper::make_tensor_map_16bit(mb, b, 2, b_dims, b_strides, b_box));
  } else {
    const uint64_t b_dims[2] = {static_cast<uint64_t>(pr.k), static_cast<uint64_t>(pr.n)};
    const uint64_t b_strides[1] = {static_cast<uint64_t>(pr.k) * 2};
    const uint32_t b_box[2] = {64, kBN};
    CHECK_CUDA(hopper::make_tensor_map_16bit(mb, b, 2, b_dims, b_strides, b_box));
  }
}

static void launch(const Problem& pr, const CUtensorMap& ma, const CUtensorMap& mb, bf16* c) {
  const int blocks = ((pr.m + kBM - 1) / kBM) * ((pr.n + kBN - 1) / kBN);
  if (pr.b_transposed) {
    gemm_kernel<true><<<blocks, kThreads, kSmemBytes>>>(ma, mb, c, pr.m, pr.n, pr.k);
  } else {
    gemm_kernel<false><<<blocks, kThreads, kSmemBytes>>>(ma, mb, c, pr.m, pr.n, pr.k);
  }
  CHECK_CUDA(cudaGetLastError());
}

// Runs one problem on random inputs; returns the relative error ||C - ref|| / ||ref|| against
// the float32 GPU reference, and, for small problems, checks that reference against a float64
// CPU product (so a wrong reference cannot pass a wrong kernel). NaN-poisoned output: an element
// the kernel never writes stays NaN and fails the check.
static double run_check(const Problem& pr, std::mt19937& rng, bool cpu_too) {
  const size_t a_n = static_cast<size_t>(pr.m) * pr.k, b_n = static_cast<size_t>(pr.n) * pr.k;
  const size_t c_n = static_cast<size_t>(pr.m) * pr.n;
  std::vector<bf16> ha(a_n), hb(b_n);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& x : ha) x = __float2bfloat16(dist(rng));
  for (auto& x : hb) x = __float2bfloat16(dist(rng));
  bf16 *a, *b, *c;
  float* ref;
  CHECK_CUDA(cudaMalloc(&a, a_n * 2));
  CHECK_CUDA(cudaMalloc(&b, b_n * 2));
  CHECK_CUDA(cudaMalloc(&c, c_n * 2));
  CHECK_CUDA(cudaMalloc(&ref, c_n * 4));
  CHECK_CUDA(cudaMemcpy(a, ha.data(), a_n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, hb.data(), b_n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(c, 0xFF, c_n * 2));  // 0xFFFF is a bfloat16 NaN
  CUtensorMap ma, mb;
  make_maps(pr, a, b, &ma, &mb);
  launch(pr, ma, mb, c);
  reference_kernel<<<dim3((pr.n + 255) / 256, pr.m), 256>>>(a, b, ref, pr.m, pr.n, pr.k, pr.b_transposed);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<bf16> hc(c_n);
  std::vector<float> hr(c_n);
  CHECK_CUDA(cudaMemcpy(hc.data(), c, c_n * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hr.data(), ref, c_n * 4, cudaMemcpyDeviceToHost));
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < c_n; ++i) {
    const double d = static_cast<double>(__bfloat162float(hc[i])) - hr[i];
    err += d * d;  // NaN propagates into err
    norm += static_cast<double>(hr[i]) * hr[i];
  }
  if (cpu_too) {
    double ref_err = 0.0;
    for (int i = 0; i < pr.m; ++i) {
      for (int j = 0; j < pr.n; ++j) {
        double sum = 0.0;
        for (int kk = 0; kk < pr.k; ++kk) {
          const float bv = pr.b_transposed ? __bfloat162float(hb[static_cast<size_t>(kk) * pr.n + j])
                                           : __bfloat162float(hb[static_cast<size_t>(j) * pr.k + kk]);
          sum += static_cast<double>(__bfloat162float(ha[static_cast<size_t>(i) * pr.k + kk])) * bv;
        }
        const double d = sum - hr[static_cast<size_t>(i) * pr.n + j];
        ref_err += d * d;
      }
    }
    if (!(std::sqrt(ref_err / norm) < 1e-5)) {
      std::printf("  the GPU reference itself is off (%.3g): stopping\n", std::sqrt(ref_err / norm));
      std::exit(1);
    }
  }
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  CHECK_CUDA(cudaFree(ref));
  return std::sqrt(err / norm);
}

static double time_ms(const Problem& pr, int reps) {
  const size_t a_n = static_cast<size_t>(pr.m) * pr.k, b_n = static_cast<size_t>(pr.n) * pr.k;
  const size_t c_n = static_cast<size_t>(pr.m) * pr.n;
  bf16 *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, a_n * 2));
  CHECK_CUDA(cudaMalloc(&b, b_n * 2));
  CHECK_CUDA(cudaMalloc(&c, c_n * 2));
  // Random bits, not zeros: a product of zeros runs faster than real data on these GPUs.
  std::vector<bf16> h(a_n > b_n ? a_n : b_n);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& x : h) x = __float2bfloat16(dist(rng));
  CHECK_CUDA(cudaMemcpy(a, h.data(), a_n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b, h.data(), b_n * 2, cudaMemcpyHostToDevice));
  CUtensorMap ma, mb;
  make_maps(pr, a, b, &ma, &mb);
  for (int i = 0; i < 3; ++i) launch(pr, ma, mb, c);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    launch(pr, ma, mb, c);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(c));
  return times[times.size() / 2];
}

int main(int argc, char** argv) {
  int major = 0, minor = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  if (major != 9 || minor != 0) {
    std::printf("this program needs a Hopper GPU (compute capability 9.0); this one is %d.%d\n", major, minor);
    return 0;
  }
  CHECK_CUDA(cudaFuncSetAttribute(gemm_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK_CUDA(cudaFuncSetAttribute(gemm_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  std::mt19937 rng(2024);
  bool ok = true;
  // Sizes that are not multiples of any tile (TMA zero-fills the edges; the epilogue guards them),
  // K a multiple of 8 (TMA's 16-byte strides), and the timing size.
  const Problem checks[] = {{128, 256, 64, false}, {200, 328, 136, false}, {257, 513, 1000, false},
                            {128, 256, 64, true},  {200, 328, 136, true},  {257, 520, 1000, true},
                            {8192, 8192, 8192, false}, {8192, 8192, 8192, true}};
  for (const Problem& pr : checks) {
    const bool small = static_cast<double>(pr.m) * pr.n * pr.k < 1e9;
    const double err = run_check(pr, rng, small);
    // bfloat16 output rounding alone is ~2^-9 relative per element, ~1.6e-3 in the norm.
    const bool pass = err < 5e-3;
    ok = ok && pass;
    std::printf("check %5d x %5d x %5d  B %s  rel err %.2e  %s\n", pr.m, pr.n, pr.k,
                pr.b_transposed ? "K x N (MN-major)" : "N x K (K-major) ", err, pass ? "ok" : "MISMATCH");
  }
  if (!ok) return 1;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  for (bool tr : {false, true}) {
    const Problem pr{8192, 8192, 8192, tr};
    const double ms = time_ms(pr, reps);
    std::printf("time 8192^3 B %s: %.3f ms, %.1f TFLOP/s\n", tr ? "MN-major" : "K-major", ms,
                2.0 * 8192.0 * 8192.0 * 8192.0 / (ms * 1e-3) / 1e12);
  }
  return 0;
}
