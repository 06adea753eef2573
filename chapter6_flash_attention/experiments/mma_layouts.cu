// Checks the two warp-level products of csrc/attention/mma.cuh (gemm_nt, gemm_rs) and the fragment
// layouts they rely on, one warp, against a CPU reference: the smallest program that can tell a
// wrong ldmatrix address or fragment order from a wrong softmax or mask in the full kernels.
//
//   nvcc -std=c++17 -arch=sm_80 -I../../common/include -I../csrc -o /tmp/mma_layouts mma_layouts.cu
//   /tmp/mma_layouts          (prints the largest error of each product; exit 1 on a mismatch)
//
// 1. gemm_nt: C (16 x 64) = A B^T, A = 16 rows of a 16 x kK tile, B = 64 rows of a 64 x kK tile
//    (the forward's S = Q K^T).
// 2. gemm_rs: D (16 x kK) = C' B, C' = the first product rounded to bfloat16 in registers
//    (the C-to-A identity), B = the 64 x kK tile read transposed (the forward's O = P V).
// Both over a padded and a swizzled tile layout, as the mma and pipelined rungs store them.
#include "attention/mma.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace fa = flash_attention;

constexpr int kK = 64;   // the head dim of the check
constexpr int kN = 64;   // keys
constexpr int kM = 16;   // one warp's rows

template <bool kSwizzle>
struct Layout {
  static constexpr int kStride = kSwizzle ? kK : kK + 8;
  __host__ __device__ static int offset(int row, int col) {
    if (kSwizzle) return row * kK + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
    return row * kStride + col;
  }
};

template <bool kSwizzle>
__global__ void products(const __nv_bfloat16* a_g, const __nv_bfloat16* b_g, float* c_g, float* d_g) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Layout<kSwizzle>;
  __shared__ __align__(16) __nv_bfloat16 a_s[kM * L::kStride];
  __shared__ __align__(16) __nv_bfloat16 b_s[kN * L::kStride];
  const int lane = threadIdx.x;
  for (int i = lane; i < kM * kK; i += 32) a_s[L::offset(i / kK, i % kK)] = a_g[i];
  for (int i = lane; i < kN * kK; i += 32) b_s[L::offset(i / kK, i % kK)] = b_g[i];
  __syncwarp();  // one warp: the tiles it wrote, visible to its own ldmatrix

  float c[kN / 8][4] = {};
  fa::mma::gemm_nt<__nv_bfloat16, L, kK, kN>(c, a_s, 0, b_s, 0, lane);
  float d[kK / 8][4] = {};
  fa::mma::gemm_rs<__nv_bfloat16, L, kN, kK>(d, c, b_s, 0, lane);

  // C fragments: (g, 8j + 2t), (g, 8j + 2t + 1), (g + 8, ...), mma.cuh's layout.
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < kN / 8; ++j) {
    for (int e = 0; e < 4; ++e) c_g[(g + 8 * (e / 2)) * kN + 8 * j + 2 * t + e % 2] = c[j][e];
  }
  for (int j = 0; j < kK / 8; ++j) {
    for (int e = 0; e < 4; ++e) d_g[(g + 8 * (e / 2)) * kK + 8 * j + 2 * t + e % 2] = d[j][e];
  }
#endif
}

template <bool kSwizzle>
bool check(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  __nv_bfloat16 *a_d, *b_d;
  float *c_d, *d_d;
  cudaMalloc(&a_d, a.size() * 2);
  cudaMalloc(&b_d, b.size() * 2);
  cudaMalloc(&c_d, kM * kN * 4);
  cudaMalloc(&d_d, kM * kK * 4);
  cudaMemcpy(a_d, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(b_d, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  products<kSwizzle><<<1, 32>>>(a_d, b_d, c_d, d_d);
  std::vector<float> c(kM * kN), d(kM * kK);
  const cudaError_t err = cudaMemcpy(c.data(), c_d, c.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(d.data(), d_d, d.size() * 4, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return false;
  }
  // The reference in double, from the same bfloat16 inputs; the second product from C rounded
  // to bfloat16, as the registers hand it over.
  double worst_c = 0, worst_d = 0;
  std::vector<float> c_rounded(kM * kN);
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      double s = 0;
      for (int k = 0; k < kK; ++k) s += double(__bfloat162float(a[i * kK + k])) * __bfloat162float(b[j * kK + k]);
      worst_c = std::fmax(worst_c, std::fabs(s - c[i * kN + j]));
      c_rounded[i * kN + j] = __bfloat162float(__float2bfloat16_rn(c[i * kN + j]));
    }
  }
  for (int i = 0; i < kM; ++i) {
    for (int k = 0; k < kK; ++k) {
      double s = 0;
      for (int j = 0; j < kN; ++j) s += double(c_rounded[i * kN + j]) * __bfloat162float(b[j * kK + k]);
      worst_d = std::fmax(worst_d, std::fabs(s - d[i * kK + k]) / (1 + std::fabs(s)));
    }
  }
  // float32 accumulation of 64 exact bfloat16 products: ~1e-5 here; a wrong fragment is O(1).
  const bool ok = worst_c < 1e-3 && worst_d < 1e-3;
  std::printf("%s layout: gemm_nt max |error| %.3g, gemm_rs max relative error %.3g: %s\n",
              kSwizzle ? "swizzled" : "padded", worst_c, worst_d, ok ? "ok" : "MISMATCH");
  cudaFree(a_d);
  cudaFree(b_d);
  cudaFree(c_d);
  cudaFree(d_d);
  return ok;
}

int main() {
  std::vector<__nv_bfloat16> a(kM * kK), b(kN * kK);
  std::srand(1);
  for (auto& x : a) x = __float2bfloat16_rn(float(std::rand()) / RAND_MAX - 0.5f);
  for (auto& x : b) x = __float2bfloat16_rn(float(std::rand()) / RAND_MAX - 0.5f);
  const bool ok = check<false>(a, b) & check<true>(a, b);
  return ok ? 0 : 1;
}
