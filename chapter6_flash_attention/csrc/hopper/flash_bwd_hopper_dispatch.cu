// The Hopper backward's launches (rung "wgmma"): the padded per-row statistics (lse in log2
// units and D = rowsum(dO * O)) with the zeros of dQ's float32 sums, the main kernel (one of the instantiations in
// flash_bwd_hopper_<dtype>_hdim<d>.cu, flash_bwd_hopper_window_<dtype>_hdim<d>.cu with a window or
// a softcap, flash_bwd_hopper_varlen_<dtype>_hdim<d>.cu in the packed layout), and dQ from its
// float32 sums.
#include "hopper/flash_bwd_hopper.h"
#include "hopper/flash_bwd_hopper_kernel.cuh"

#include <course/cuda_utils.h>
#include <course/index_math.h>
#include <course/numeric.cuh>
#include <course/reduce.cuh>
#include <course/static_switch.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace flash_attention {

// Instantiated in flash_bwd_hopper_<dtype>_hdim<d>.cu and its window_ and varlen_ twins, one file
// each, compiled in parallel: extern here, so that this file (which includes the kernel for
// HopperBwdTraits' sizes) does not compile them all again.
#define FLASH_BWD_HOPPER_EXTERN(T, D, W, V)                                                            \
  extern template cudaError_t run_flash_bwd_hopper<T, D, W, V>(const AttentionBackwardParams&, float*, \
                                                               const float*, const float*, cudaStream_t);
#define FLASH_BWD_HOPPER_EXTERN_ALL(T, D)      \
  FLASH_BWD_HOPPER_EXTERN(T, D, false, false) \
  FLASH_BWD_HOPPER_EXTERN(T, D, true, false)  \
  FLASH_BWD_HOPPER_EXTERN(T, D, false, true)
FLASH_BWD_HOPPER_EXTERN_ALL(__nv_bfloat16, 64)
FLASH_BWD_HOPPER_EXTERN_ALL(__nv_bfloat16, 128)
FLASH_BWD_HOPPER_EXTERN_ALL(__half, 64)
FLASH_BWD_HOPPER_EXTERN_ALL(__half, 128)
#undef FLASH_BWD_HOPPER_EXTERN_ALL
#undef FLASH_BWD_HOPPER_EXTERN

namespace {

constexpr int kThreads = 256;

// Packed: the sequence whose rows hold statistics row `pr` of a head (flash_bwd_hopper.h's
// hopper_bwd_seq_row0, which grows by at least a tile from one sequence to the next, empty ones
// included): the last b whose first row is at or before pr, by bisection over cu_seqlens_q. Row pr
// is then the sequence's row pr - hopper_bwd_seq_row0(...), a padding row at or past its length.
__device__ __forceinline__ int64_t packed_sequence(const AttentionParams& p, int64_t pr) {
  int64_t lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (hopper_bwd_seq_row0(p.cu_seqlens_q[mid], mid) <= pr) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Where statistics row pr of a head, in sequence b's rows (packed_sequence), lands in the packed
// tensors: its token, or -1 for a padding row (past the sequence's length, clamped at 0 as
// varlen.cuh's sequence_params clamps it).
__device__ __forceinline__ int64_t packed_token(const AttentionParams& p, int64_t b, int64_t pr) {
  const int64_t q0 = p.cu_seqlens_q[b];
  const int64_t len = max(int64_t{0}, p.cu_seqlens_q[b + 1] - q0);
  const int64_t i = pr - hopper_bwd_seq_row0(q0, b);
  return i < len ? q0 + i : -1;
}

// The old side kernels (HopperBwdSide::kOld, flash_bwd_hopper.h), kept for one GPU run that times
// them beside the new ones below (bwd_hopper_rows_kernel, bwd_hopper_dq_kernel).
//
// Row r = (b * heads + h) * rows_pad + i of the padded statistics, one warp per row: for a real
// row, lse2 = lse log2(e) (+inf where lse is -inf: a row that sees no key, whose P must be 0) and
// D = sum over d of dO * O in float32; for a padding row (i >= seqlen_q), +inf and 0, so that its
// P, and with it every product it enters, is exactly 0. Packed (kVarlen): r = h * rows_pad + pr,
// rows_pad the packed rows of a head, pr a sequence's row or a padding row (packed_token).
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads)
    bwd_hopper_rows_warp_kernel(const AttentionBackwardParams g, int64_t rows_pad, float* lse2_rows, float* d_rows) {
  const AttentionParams& p = g.fwd;
  const int64_t rows = (kVarlen ? 1 : p.batch) * p.heads * rows_pad;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const int64_t bh = r / rows_pad;
    // Padded: batch b, head h, row i, lse row bh * seqlen_q + i. Packed: head bh, token i (every
    // batch stride 0), lse row h * total_q + i.
    int64_t i = r % rows_pad;
    if constexpr (kVarlen) i = packed_token(p, packed_sequence(p, i), i);
    if (kVarlen ? i < 0 : i >= p.seqlen_q) {  // uniform across the warp: one row per warp
      if (lane == 0) lse2_rows[r] = INFINITY, d_rows[r] = 0.f;
      continue;
    }
    const int64_t b = kVarlen ? 0 : bh / p.heads;
    const int64_t h = kVarlen ? bh : bh % p.heads;
    const T* o = static_cast<const T*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + i * p.o_seq_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride + i * g.do_seq_stride;
    float sum = 0.f;
    for (int64_t c = lane; c < p.head_dim; c += 32) sum += course::to_acc(o[c]) * course::to_acc(dout[c]);
    sum = course::warp_reduce(sum, course::SumOp<float>{});
    if (lane == 0) {
      const float lse = static_cast<const float*>(p.lse)[kVarlen ? h * p.total_q + i : bh * p.seqlen_q + i];
      lse2_rows[r] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      d_rows[r] = sum;
    }
  }
}

// dq = scale * (the float32 sums of the real rows), rounded once to T, in dq's strides. The sums
// are in the main kernel's register order (attention_backward_hopper_workspace): float4 q of a
// tile's 64-column chunk is float4 g = q / 128 of thread ct = q % 128 of the warpgroup that
// computed it, its registers 4g..4g+3: rows 16 (ct / 32) + (ct % 32) / 4 and that + 8, columns
// 8g + 2 (ct % 4) and the next. One float4 a thread: the reads are whole and coalesced, and four
// consecutive threads write 8 consecutive elements of a row. Packed (kVarlen): the rows of head bh
// are packed rows, each mapped to its token (packed_token; padding rows have nowhere to go).
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads)
    bwd_hopper_dq_scattered_kernel(const AttentionBackwardParams g, int64_t rows_pad, const float* dq_accum) {
  constexpr int kBM = kHopperBwdDqRows;  // the sums' tiles (a step of 128 rows at d = 64 is two)
  const AttentionParams& p = g.fwd;
  const int64_t tile_floats = kBM * p.head_dim;  // one query tile's sums, every chunk
  const int64_t total = (kVarlen ? 1 : p.batch) * p.heads * rows_pad * p.head_dim / 4;
  const float scale = static_cast<float>(p.scale);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = 4 * q;
    const int64_t bh = e / (rows_pad * p.head_dim);
    const int64_t m0 = e % (rows_pad * p.head_dim) / tile_floats * kBM;
    const int in_tile = static_cast<int>(e % tile_floats);
    const int chunk = in_tile / (kBM * 64);
    const int f = in_tile % (kBM * 64);
    const int ct = f / 4 % 128;
    const int64_t row = m0 + 16 * (ct / 32) + ct % 32 / 4;
    const int col = chunk * 64 + 8 * (f / 512) + 2 * (ct % 4);
    const float4 v = *reinterpret_cast<const float4*>(dq_accum + e);
    if constexpr (kVarlen) {
      T* dq = static_cast<T*>(g.dq) + bh * g.dq_head_stride + col;
      const int64_t seq = packed_sequence(p, m0);  // the tile's rows are one sequence's
      const int64_t token = packed_token(p, seq, row), token8 = packed_token(p, seq, row + 8);
      if (token >= 0) {  // padding rows' sums are 0 and have nowhere to go
        dq[token * g.dq_seq_stride] = course::from_acc<T>(v.x * scale);
        dq[token * g.dq_seq_stride + 1] = course::from_acc<T>(v.y * scale);
      }
      if (token8 >= 0) {
        dq[token8 * g.dq_seq_stride] = course::from_acc<T>(v.z * scale);
        dq[token8 * g.dq_seq_stride + 1] = course::from_acc<T>(v.w * scale);
      }
      continue;
    }
    T* dq = static_cast<T*>(g.dq) + (bh / p.heads) * g.dq_batch_stride + (bh % p.heads) * g.dq_head_stride + col;
    if (row < p.seqlen_q) {  // padded rows' sums are 0 and have nowhere to go
      dq[row * g.dq_seq_stride] = course::from_acc<T>(v.x * scale);
      dq[row * g.dq_seq_stride + 1] = course::from_acc<T>(v.y * scale);
    }
    if (row + 8 < p.seqlen_q) {
      dq[(row + 8) * g.dq_seq_stride] = course::from_acc<T>(v.z * scale);
      dq[(row + 8) * g.dq_seq_stride + 1] = course::from_acc<T>(v.w * scale);
    }
  }
}

// The new side kernels (HopperBwdSide::kNew, and kElementwise: the same kernels with kVec false).
//
// Statistics rows a thread takes per pass of bwd_hopper_rows_kernel, every load of them (16 bytes
// of O and 16 of dO a row) issued before the first sum. One: 32 bytes in flight a thread, 64 KiB an
// SM at 2048 threads, where a memory-bound kernel wants about bandwidth x latency (~4.8 TB/s x
// ~0.8 us over 132 SMs, ~30 KiB an SM on an H200). Two rows spilled (60-100 bytes a thread, ptxas
// -v, sm_90a) at the 32 registers that 8 blocks of 256 threads an SM leave.
constexpr int kStatRowsPerThread = 1;

// The new side kernels' __launch_bounds__ minimum of blocks an SM: the 8 of 256 threads that the
// grid assumes (kGridStrideBlocksPerSm), which caps them at 32 registers. On the sweep's other
// targets (sm_75's SM holds 1024 threads: ptxas would drop the bound with a warning) 1, since the
// glue launches this file's kernels on sm_90a alone.
constexpr int kSideBlocksPerSm = COURSE_HOPPER_DEVICE ? static_cast<int>(kGridStrideBlocksPerSm) : 1;

// 16 bytes of a row from `from`: one 128-bit load (kVec: `from` 16-byte aligned), else element by
// element (any alignment).
template <typename T, bool kVec>
__device__ __forceinline__ course::Vec16<T> load_part(const T* from) {
  if constexpr (kVec) {
    return course::load16(reinterpret_cast<const course::Vec16<T>*>(from));
  } else {
    course::Vec16<T> v;
#pragma unroll
    for (int e = 0; e < course::Vec16<T>::kLanes; ++e) v.v[e] = from[e];
    return v;
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store_part(T* to, const course::Vec16<T>& v) {
  if constexpr (kVec) {
    course::store16(reinterpret_cast<course::Vec16<T>*>(to), v);
  } else {
#pragma unroll
    for (int e = 0; e < course::Vec16<T>::kLanes; ++e) to[e] = v.v[e];
  }
}

// Two floats rounded to T (course::from_acc, the scattered kernel's rounding), as one 4-byte word:
// lo in the low half, the element at the lower address.
template <typename T>
__device__ __forceinline__ uint32_t rounded_pair(float lo, float hi) {
  const T pair[2] = {course::from_acc<T>(lo), course::from_acc<T>(hi)};
  uint32_t word;
  memcpy(&word, pair, sizeof(word));
  return word;
}

// Statistics row r of the workspace: its batch b and head h, and its query row (padded) or token
// (packed) i, -1 for a padding row (bwd_hopper_rows_warp_kernel's mapping). 32-bit division: the
// launcher keeps the statistics rows below 2^31 (far above any workspace that fits a GPU: 2^31
// rows are 1 TiB of sums at d = 128), and a 64-bit division is a called routine whose registers
// pushed the kernel past 32 and spilled (ptxas -v, sm_90a).
struct StatRow {
  int64_t b, h, i;
};
template <bool kVarlen>
__device__ __forceinline__ StatRow stat_row(const AttentionParams& p, unsigned rows_pad, unsigned r) {
  const unsigned bh = r / rows_pad;
  const unsigned i = r % rows_pad;
  if constexpr (kVarlen) {
    return {0, bh, packed_token(p, packed_sequence(p, i), i)};
  } else {
    const unsigned heads = static_cast<unsigned>(p.heads);
    return {bh / heads, bh % heads, i < p.seqlen_q ? int64_t{i} : -1};
  }
}

// Statistics row r as bwd_hopper_rows_warp_kernel computes it (lse2; D = rowsum(dO * O) in
// float32; +inf and 0 on padding rows), a row now read by d / 8 adjacent threads, 16 bytes of O
// and of dO each (kVec; element by element otherwise), and summed over them by a butterfly of
// width d / 8: 2 rows a warp at d = 128 and 4 at d = 64, every lane loading, where the warp per
// row made 64-byte warp loads (and left half its lanes idle at d = 64). The same threads zero row
// r's d floats of dQ's sums, 32 bytes each (a warp's stores are 1 KiB contiguous), so the workspace
// comes from at::empty and no memset pass runs before: a row writes 4d bytes of zeros as it reads
// 2 x 2d, and the stores, issued between the loads and their use, wait for nothing.
// The grid covers every statistics row, padding included: the main kernel's bulk reductions add
// into every one of its rows' sums (padding rows too: their dS is 0), and dQ's conversion reads all.
// `rows`: attention_backward_hopper_stat_rows, below 2^31 (stat_row).
template <typename T, bool kVarlen, bool kVec>
__global__ void __launch_bounds__(kThreads, kSideBlocksPerSm)
    bwd_hopper_rows_kernel(const AttentionBackwardParams g, unsigned rows_pad, unsigned rows, float* dq_accum,
                           float* lse2_rows, float* d_rows) {
  using V = course::Vec16<T>;
  constexpr int R = kStatRowsPerThread;
  const AttentionParams& p = g.fwd;
  const unsigned lanes = static_cast<unsigned>(p.head_dim) / V::kLanes;  // a row's threads: 32 / 2^k (launch)
  const unsigned part = threadIdx.x % lanes;                             // which 8 columns
  const unsigned groups = kThreads / lanes;                              // rows a block takes per load
  const unsigned first = threadIdx.x / lanes;                            // this thread's row of them
  // The loop's trip count is the block's, so every lane of a warp reaches the butterfly below.
  // r0 in 64 bits: it passes `rows` before the loop ends.
  for (int64_t r0 = int64_t{blockIdx.x} * groups * R; r0 < rows; r0 += int64_t{gridDim.x} * groups * R) {
    V o[R], dout[R];
    float lse[R];
    bool real[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = r0 + j * groups + first;
      const StatRow s = stat_row<kVarlen>(p, rows_pad, static_cast<unsigned>(r < rows ? r : rows - 1));
      real[j] = r < rows && s.i >= 0;  // past the grid's last row, or a padding row: no load
      o[j] = V{}, dout[j] = V{}, lse[j] = 0.f;
      if (real[j]) {
        const int64_t c = int64_t{part} * V::kLanes;
        o[j] = load_part<T, kVec>(static_cast<const T*>(p.o) + s.b * p.o_batch_stride + s.h * p.o_head_stride +
                                  s.i * p.o_seq_stride + c);
        dout[j] = load_part<T, kVec>(static_cast<const T*>(g.dout) + s.b * g.do_batch_stride +
                                     s.h * g.do_head_stride + s.i * g.do_seq_stride + c);
        if (part == 0) {
          lse[j] = static_cast<const float*>(p.lse)[kVarlen ? s.h * p.total_q + s.i
                                                            : (s.b * p.heads + s.h) * p.seqlen_q + s.i];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = r0 + j * groups + first;
      if (r < rows) {  // dQ's sums have exactly `rows` rows of d floats
        float4* sums = reinterpret_cast<float4*>(dq_accum + r * p.head_dim) + 2 * part;
        sums[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        sums[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < V::kLanes; ++e) sum += course::to_acc(o[j].v[e]) * course::to_acc(dout[j].v[e]);
      sum = course::warp_reduce(sum, course::SumOp<float>{}, static_cast<int>(lanes));
      const int64_t r = r0 + j * groups + first;
      if (part == 0 && r < rows) {
        lse2_rows[r] = !real[j] || lse[j] == -INFINITY ? INFINITY : lse[j] * 1.4426950408889634f;
        d_rows[r] = real[j] ? sum : 0.f;
      }
    }
  }
}

// dq = scale * (the float32 sums of the real rows), rounded once to T (the scattered kernel's
// result, bit for bit), one 64 x 64 chunk of the sums (kHopperBwdDqRows rows by 64 columns, 16 KiB
// in the main kernel's register order) a block at a time: its 256 threads read the chunk whole, a
// float4 four times each (a warp reads 512 contiguous bytes), scale and round each float pair into
// one 4-byte word of a row-major tile in shared memory, and then write the tile's rows to dq 16
// bytes a thread (kVec; element by element otherwise): a warp stores 4 rows x 128 contiguous bytes,
// whole lines, where the scattered kernel's warp stored 4 bytes at each of 32 places over 16 rows.
// The tile's rows are 72 elements apart (144 bytes, 36 banks): a warp's word stores (8 rows,
// 4 adjacent words each: rows 16 (ct / 32) + (ct % 32) / 4, words 4 (f / 128) + ct % 4) land on
// banks 4 (row % 8) + 4 (f / 128) + ct % 4 (mod 32), all 32 distinct; each 8-lane phase of its
// 16-byte loads reads one row's 32 words. Packed (kVarlen): a tile's rows are one sequence's
// (packed_token; padding rows have nowhere to go).
template <typename T, bool kVarlen, bool kVec>
__global__ void __launch_bounds__(kThreads, kSideBlocksPerSm)
    bwd_hopper_dq_kernel(const AttentionBackwardParams g, unsigned rows_pad, unsigned chunks, const float* dq_accum) {
  using V = course::Vec16<T>;
  constexpr int kBM = kHopperBwdDqRows;
  constexpr int kCols = 64;                                     // a chunk's columns (the workspace's layout)
  constexpr int kPitchWords = (kCols + V::kLanes) / 2;         // 36 words, 144 bytes a tile row
  constexpr int kLoads = kBM * kCols / 4 / kThreads;           // float4s of the chunk a thread reads: 4
  constexpr int kStores = kBM * kCols / V::kLanes / kThreads;  // 16-byte vectors of dq it writes: 2
  constexpr int kParts = kCols / V::kLanes;                    // vectors a tile row: 8
  __shared__ alignas(16) uint32_t tile[kBM * kPitchWords];
  const AttentionParams& p = g.fwd;
  const unsigned chunks_per_tile = static_cast<unsigned>(p.head_dim) / kCols;
  const unsigned tiles_per_head = rows_pad / kBM;
  const float scale = static_cast<float>(p.scale);
  for (unsigned c = blockIdx.x; c < chunks; c += gridDim.x) {
    const float4* sums = reinterpret_cast<const float4*>(dq_accum) + int64_t{c} * (kBM * kCols / 4);
    float4 v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) v[j] = sums[threadIdx.x + j * kThreads];
    __syncthreads();  // every thread has read the previous chunk's tile before any writes over it
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      // float4 f of a chunk is float4 f / 128 of thread ct = f % 128 of the warpgroup that summed it:
      // rows 16 (ct / 32) + (ct % 32) / 4 and that + 8, columns 8 (f / 128) + 2 (ct % 4) and the next.
      const int f = static_cast<int>(threadIdx.x) + j * kThreads;
      const int ct = f % 128;
      const int r = 16 * (ct / 32) + ct % 32 / 4;
      const int w = 4 * (f / 128) + ct % 4;
      tile[r * kPitchWords + w] = rounded_pair<T>(v[j].x * scale, v[j].y * scale);
      tile[(r + 8) * kPitchWords + w] = rounded_pair<T>(v[j].z * scale, v[j].w * scale);
    }
    __syncthreads();  // the tile is whole before a thread reads the words that others wrote
    const unsigned tile_index = c / chunks_per_tile;
    const unsigned bh = tile_index / tiles_per_head;
    const int64_t m0 = int64_t{tile_index % tiles_per_head} * kBM;
    const int col0 = static_cast<int>(c % chunks_per_tile) * kCols;
    const unsigned heads = static_cast<unsigned>(p.heads);  // below 2^31 with bh (32-bit division)
    T* dq = static_cast<T*>(g.dq) + col0 +
            (kVarlen ? bh * g.dq_head_stride : (bh / heads) * g.dq_batch_stride + (bh % heads) * g.dq_head_stride);
    [[maybe_unused]] const int64_t seq = kVarlen ? packed_sequence(p, m0) : 0;  // the tile's rows are one sequence's
#pragma unroll
    for (int j = 0; j < kStores; ++j) {
      const int u = static_cast<int>(threadIdx.x) + j * kThreads;
      const int r = u / kParts, part = u % kParts;
      const int64_t i = kVarlen ? packed_token(p, seq, m0 + r) : (m0 + r < p.seqlen_q ? m0 + r : -1);
      if (i < 0) continue;  // a padding row: its sums are 0 and it has nowhere to go
      const V x = course::load16(reinterpret_cast<const V*>(&tile[r * kPitchWords + part * (V::kLanes / 2)]));
      store_part<T, kVec>(dq + i * g.dq_seq_stride + part * V::kLanes, x);
    }
  }
}

// dK and dV of a call without query rows (seqlen_q or heads 0): no key is seen, every gradient 0.
// The main kernel would write them too, but its query maps would describe an empty tensor.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_hopper_zero_kv_kernel(const AttentionBackwardParams g) {
  const AttentionParams& p = g.fwd;
  const int64_t total = p.batch * p.heads_kv * p.seqlen_k * p.head_dim;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = e % p.head_dim;
    const int64_t r = e / p.head_dim;
    const int64_t key = r % p.seqlen_k;
    const int64_t b = r / p.seqlen_k / p.heads_kv;
    const int64_t hk = r / p.seqlen_k % p.heads_kv;
    static_cast<T*>(g.dk)[b * g.dk_batch_stride + hk * g.dk_head_stride + key * g.dk_seq_stride + c] = course::from_acc<T>(0.f);
    static_cast<T*>(g.dv)[b * g.dv_batch_stride + hk * g.dv_head_stride + key * g.dv_seq_stride + c] = course::from_acc<T>(0.f);
  }
}

// Whether a (batch, head, row) view of 16-bit elements takes the new side kernels' 16-byte
// accesses at every row: its base 16-byte aligned and every stride that is stepped (a dim of more
// than one index) a whole number of 16-byte vectors.
bool rows_of_vectors(const void* base, int64_t batch, int64_t batch_stride, int64_t heads, int64_t head_stride,
                     int64_t rows, int64_t seq_stride) {
  const auto whole = [](int64_t size, int64_t stride) { return size <= 1 || stride % 8 == 0; };
  return course::is_aligned(base, 16) && whole(batch, batch_stride) && whole(heads, head_stride) &&
         whole(rows, seq_stride);
}

template <typename T, bool kVarlen>
cudaError_t launch(const AttentionBackwardParams& g, HopperBwdSide side, void* workspace, cudaStream_t stream) {
  if (side == HopperBwdSide::kUnknown) return cudaErrorInvalidValue;
  const AttentionParams& p = g.fwd;
  // Statistics rows per head (padded: per batch and head), and in all.
  const int64_t rows_pad = kVarlen ? attention_backward_hopper_packed_rows(p.total_q, p.batch)
                                   : attention_backward_hopper_rows(p.seqlen_q);
  const int64_t rows = attention_backward_hopper_stat_rows(p);
  // The workspace (attention_backward_hopper_workspace): dQ's sums, then lse2, then D; each part
  // a multiple of 256 bytes long (rows_pad is), so the bulk copies' 16-byte alignment holds.
  float* dq_accum = static_cast<float*>(workspace);
  float* lse2_rows = dq_accum + rows * p.head_dim;
  float* d_rows = lse2_rows + rows;
  int sms = 0;
  COURSE_CUDA_TRY(course::sm_count(&sms));
  // No query row (packed: no query token, though the padded rows of empty sequences exist).
  if (kVarlen ? p.total_q == 0 || p.heads == 0 : rows == 0) {
    // Packed: every key token as one batch, which covers the keys of every sequence.
    AttentionBackwardParams every = g;
    if constexpr (kVarlen) every.fwd.batch = 1, every.fwd.seqlen_k = p.total_k;
    const int64_t work = every.fwd.batch * p.heads_kv * every.fwd.seqlen_k * p.head_dim;
    if (work == 0) return cudaSuccess;
    bwd_hopper_zero_kv_kernel<T><<<static_cast<unsigned>(grid_stride_blocks(work, kThreads * 4, sms)), kThreads, 0,
                                   stream>>>(every);
    return cudaGetLastError();
  }
  // The views as the kernels see them: packed, one batch of total_q tokens (batch strides 0).
  const int64_t batch = kVarlen ? 1 : p.batch, seq = kVarlen ? p.total_q : p.seqlen_q;
  const bool old = side == HopperBwdSide::kOld;
  // The new kernels' 32-bit row and chunk indices (stat_row).
  if (!old && rows > INT_MAX) return cudaErrorInvalidConfiguration;
  if (old) {
    bwd_hopper_rows_warp_kernel<T, kVarlen><<<static_cast<unsigned>(grid_stride_blocks(rows, kThreads / 32, sms)),
                                              kThreads, 0, stream>>>(g, rows_pad, lse2_rows, d_rows);
  } else {
    // A row's d / 8 threads share a warp (a butterfly of width d / 8): every listed head dim is one.
    const int64_t lanes = p.head_dim / 8;
    if (p.head_dim % 8 != 0 || lanes > 32 || (32 % lanes) != 0) return cudaErrorInvalidValue;
    const bool vec = side == HopperBwdSide::kNew &&
                     rows_of_vectors(p.o, batch, p.o_batch_stride, p.heads, p.o_head_stride, seq, p.o_seq_stride) &&
                     rows_of_vectors(g.dout, batch, g.do_batch_stride, p.heads, g.do_head_stride, seq, g.do_seq_stride);
    const auto blocks = static_cast<unsigned>(grid_stride_blocks(rows, kThreads / lanes * kStatRowsPerThread, sms));
    const auto rows32 = static_cast<unsigned>(rows), rows_pad32 = static_cast<unsigned>(rows_pad);
    if (vec) {
      bwd_hopper_rows_kernel<T, kVarlen, true>
          <<<blocks, kThreads, 0, stream>>>(g, rows_pad32, rows32, dq_accum, lse2_rows, d_rows);
    } else {
      bwd_hopper_rows_kernel<T, kVarlen, false>
          <<<blocks, kThreads, 0, stream>>>(g, rows_pad32, rows32, dq_accum, lse2_rows, d_rows);
    }
  }
  COURSE_CUDA_TRY(cudaGetLastError());
  // The instantiation: a window or a softcap, or the packed layout, or neither (both at once never
  // come here: the glue sends them to "mma_dqpass"). The glue checks attention_backward_hopper_head_dim
  // first: the fallback answers a call from C++ alone.
  const bool featured = uses_window_or_softcap(p);
  if (kVarlen && featured) return cudaErrorInvalidValue;
  COURSE_CUDA_TRY(course::with_listed<kHopperBackwardHeadDims>(p.head_dim, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (kVarlen) {
      return run_flash_bwd_hopper<T, D, false, true>(g, dq_accum, lse2_rows, d_rows, stream);
    } else {
      return featured ? run_flash_bwd_hopper<T, D, true, false>(g, dq_accum, lse2_rows, d_rows, stream)
                      : run_flash_bwd_hopper<T, D, false, false>(g, dq_accum, lse2_rows, d_rows, stream);
    }
  }));
  if (old) {
    const int64_t float4s = rows * p.head_dim / 4;
    bwd_hopper_dq_scattered_kernel<T, kVarlen><<<static_cast<unsigned>(grid_stride_blocks(float4s, kThreads * 4, sms)),
                                                 kThreads, 0, stream>>>(g, rows_pad, dq_accum);
    return cudaGetLastError();
  }
  // A block per 64 x 64 chunk of the sums (rows is a whole number of 128-row tiles per head, and
  // head_dim a multiple of 64: kHopperBackwardHeadDims).
  // 32-bit chunk indices: rows is below 2^31 (checked above), so the chunks are below 2^26.
  const auto chunks = static_cast<unsigned>(rows / kHopperBwdDqRows * (p.head_dim / 64));
  const auto blocks = static_cast<unsigned>(grid_stride_blocks(chunks, 1, sms));
  const auto rows_pad32 = static_cast<unsigned>(rows_pad);
  const bool vec = side == HopperBwdSide::kNew &&
                   rows_of_vectors(g.dq, batch, g.dq_batch_stride, p.heads, g.dq_head_stride, seq, g.dq_seq_stride);
  if (vec) {
    bwd_hopper_dq_kernel<T, kVarlen, true><<<blocks, kThreads, 0, stream>>>(g, rows_pad32, chunks, dq_accum);
  } else {
    bwd_hopper_dq_kernel<T, kVarlen, false><<<blocks, kThreads, 0, stream>>>(g, rows_pad32, chunks, dq_accum);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t attention_backward_hopper_smem_bytes(int64_t head_dim) {
  return course::with_listed<kHopperBackwardHeadDims>(
      head_dim, int64_t{0}, [](auto d) -> int64_t { return HopperBwdTraits<decltype(d)::value>::kSmemBytes; });
}

HopperBwdSide attention_backward_hopper_side() {
  const char* name = std::getenv("FLASH_ATTENTION_BWD_SIDE");
  if (name == nullptr || *name == '\0' || std::strcmp(name, "new") == 0) return HopperBwdSide::kNew;
  if (std::strcmp(name, "elementwise") == 0) return HopperBwdSide::kElementwise;
  if (std::strcmp(name, "old") == 0) return HopperBwdSide::kOld;
  return HopperBwdSide::kUnknown;
}

cudaError_t launch_attention_backward_hopper(const AttentionBackwardParams& g, HopperBwdSide side, void* workspace,
                                             cudaStream_t stream) {
  const bool packed = g.fwd.cu_seqlens_q != nullptr;
  switch (g.fwd.dtype) {
    case DType::kBFloat16:
      return packed ? launch<__nv_bfloat16, true>(g, side, workspace, stream)
                    : launch<__nv_bfloat16, false>(g, side, workspace, stream);
    case DType::kFloat16:
      return packed ? launch<__half, true>(g, side, workspace, stream)
                    : launch<__half, false>(g, side, workspace, stream);
    default: return cudaErrorInvalidValue;  // the glue sends only the 16-bit types here
  }
}

}  // namespace flash_attention
