// Chapter 6, backward rung 2: "mma", FlashAttention 2's backward on tensor cores. Included only
// by the instantiation files flash_bwd_<dtype>_hdim<d>.cu.
//
// The derivation (attention.h): with P = exp(S - lse) recomputed from the forward's lse and
// D = rowsum(dO * O) (flash_bwd_dispatch.cu's preprocess kernel),
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale dS K,   dK = scale dS^T Q.
// A block holds K and V of its kBlockN keys (flash_bwd.h: the work split) and, per query tile,
// Q, dO, lse and D. Each warp computes, for its 16 keys and the tile's 64 rows, with keys as
// the mma's m:
//   S^T  = K_w Q^T          A: K rows (ldmatrix)            B: Q rows (ldmatrix, n-major)
//   P^T  = exp2(S^T scale log2(e) - lse log2(e)), 0 where the key is not visible
//   dV_w += P^T dO          A: P^T from the S^T registers   B: dO (ldmatrix.trans, k-major)
//   dP^T = V_w dO^T         A: V rows (ldmatrix)            B: dO rows (ldmatrix)
//   dS^T = P^T * (dP^T - D)
//   dK_w += dS^T Q          A: dS^T from registers          B: Q (ldmatrix.trans)
// and stores dS^T (16-bit) to shared memory. After a barrier, warp w takes rows 16w..16w+15 of
// the tile for dQ += dS K: A is dS, read from the dS^T tile with ldmatrix.trans (a transposed
// store read transposed is the A layout), B is K (ldmatrix.trans); the products go to the
// float32 dQ with atomicAdd. The C-to-A register identity of the forward (mma.cuh) serves twice
// here: P^T and dS^T are A operands straight from the accumulators.
//
// The loads are synchronous and every tile is masked: the pipelining of the forward's rung 4 is
// the next step for this pass. dQ's atomics make the float32 sums' order, and so dQ's last bits,
// vary from run to run.
//
// No torch headers: this file builds with a bare `nvcc -c`.
#pragma once

#include "../attention.h"
#include "flash_bwd.h"
#include "flash_tiles.cuh"
#include "mma.cuh"

#include <course/cuda_utils.h>

#include <climits>
#include <cstdint>

namespace flash_attention {

// kDqAtomic: this kernel also adds each key tile's dQ into the float32 sums (rung "mma");
// without it, it computes dK and dV only and flash_bwd_dq_kernel below makes dQ (rung
// "mma_dqpass").
template <typename T, typename K, bool kDqAtomic>
__global__ void __launch_bounds__(K::kThreads)
    flash_bwd_kernel(const AttentionBackwardParams g, float* __restrict__ dq_accum, const float* __restrict__ d_rows,
                     unsigned k_tiles, float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kMTiles = K::kBlockM / 8;  // n8 tiles of S^T (query rows as n)
  constexpr int kDTiles = kD / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionParams& p = g.fwd;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* do_s = q_s + K::kTileElems;
  T* k_s = do_s + K::kTileElems;
  T* v_s = k_s + K::kTileElems;
  T* ds_s = v_s + K::kTileElems;
  float* lse_s = reinterpret_cast<float*>(ds_s + K::kBlockN * K::kDsStride);
  float* dr_s = lse_s + K::kBlockM;

  // Flattened grid, key tiles fastest: (key tile, batch, kv head).
  const int64_t tile = blockIdx.x % k_tiles;
  const int64_t bhk = blockIdx.x / k_tiles;
  const int64_t b = bhk / p.heads_kv;
  const int64_t hk = bhk % p.heads_kv;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t n0 = tile * K::kBlockN;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gr = lane / 4;  // mma.cuh's g
  const int t = lane % 4;
  const int64_t diag = p.seqlen_k - p.seqlen_q;

  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, n0, p.seqlen_k);
  load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, n0, p.seqlen_k);

  float dk[kDTiles][4];
  float dv[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;
  }

  // The first query row that sees any key of the tile: causal rows above it see none of them.
  const int64_t m_first = first_visible_row(n0, p.seqlen_q, p.seqlen_k, p.causal);
  const int64_t m_begin = m_first / K::kBlockM * K::kBlockM;

  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * p.heads + h;
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride;
    float* dq = kDqAtomic ? dq_accum + bh * p.seqlen_q * kD : nullptr;
    for (int64_t m0 = m_begin; m0 < p.seqlen_q; m0 += K::kBlockM) {
      load_tile<K, K::kBlockM>(q_s, q, p.q_seq_stride, m0, p.seqlen_q);
      load_tile<K, K::kBlockM>(do_s, dout, g.do_seq_stride, m0, p.seqlen_q);
      for (int i = threadIdx.x; i < K::kBlockM; i += K::kThreads) {
        const int64_t row = m0 + i;
        // lse in log2 units; +inf for rows past the end and rows without a visible key (lse
        // -inf), so that their exp2(s - lse) is 0 whatever the mask says.
        const float lse = row < p.seqlen_q ? static_cast<const float*>(p.lse)[bh * p.seqlen_q + row] : INFINITY;
        lse_s[i] = lse == -INFINITY ? INFINITY : lse * kLog2e;
        dr_s[i] = row < p.seqlen_q ? d_rows[bh * p.seqlen_q + row] : 0.f;
      }
      // The tiles (K and V on the first trip too) and the row statistics, visible to every warp.
      __syncthreads();

      // S^T = K_w Q^T: the warp's 16 keys x the tile's 64 rows.
      float st[kMTiles][4];
      float dpt[kMTiles][4];
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
      }
      mma::gemm_nt<T, K, kD, K::kBlockM>(st, k_s, warp * 16, q_s, 0, lane);
      mma::gemm_nt<T, K, kD, K::kBlockM>(dpt, v_s, warp * 16, do_s, 0, lane);

      // P^T and dS^T in place: element st[j][e] is key n0 + 16w + gr + 8(e / 2), query row
      // m0 + 8j + 2t + e % 2.
#pragma unroll
      for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 8 * j + 2 * t + e % 2;
          const int64_t key = n0 + 16 * warp + gr + 8 * (e / 2);
          const int64_t row = m0 + i;
          const bool visible = key < p.seqlen_k && (!p.causal || key <= row + diag);
          const float pt = visible ? exp2f(st[j][e] * scale_log2 - lse_s[i]) : 0.f;
          st[j][e] = pt;
          dpt[j][e] = pt * (dpt[j][e] - dr_s[i]);  // dS^T
        }
      }

      // dV_w += P^T dO and dK_w += dS^T Q, the k dimension being the tile's query rows.
      mma::gemm_rs<T, K, K::kBlockM, kD>(dv, st, do_s, 0, lane);
      mma::gemm_rs<T, K, K::kBlockM, kD>(dk, dpt, q_s, 0, lane);

      if constexpr (kDqAtomic) {
        // dS^T to shared memory, rounded to T as the mma will read it: row 16w + gr (+8) of the
        // tile's keys, columns 8j + 2t and + 1 (one 4-byte store).
#pragma unroll
        for (int j = 0; j < kMTiles; ++j) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            *reinterpret_cast<uint32_t*>(ds_s + (16 * warp + gr + 8 * r) * K::kDsStride + 8 * j + 2 * t) =
                mma::pack2<T>(dpt[j][2 * r], dpt[j][2 * r + 1]);
          }
        }
        // Every warp's dS^T rows are in shared memory before any warp reads a column of them.
        __syncthreads();

        // dQ rows 16w..16w+15 of the tile += dS K over the block's 64 keys, d in n8 tiles.
        float acc[kDTiles][4];
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K::kBlockN / 16; ++kk) {
          // A = dS (rows x keys) from the dS^T tile (keys x rows), read transposed: matrices
          // (keys 0-7, rows 0-7), (keys 0-7, rows 8-15), (keys 8-15, rows 0-7), (keys 8-15, rows 8-15).
          uint32_t a[4];
          mma::ldmatrix_x4_trans(a, mma::smem_address(ds_s + (kk * 16 + lane % 8 + (lane / 16) * 8) * K::kDsStride +
                                                      warp * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
          for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t bk[4];
            mma::ldmatrix_x4_trans(bk, mma::smem_address(k_s + K::offset(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                                         dp * 16 + (lane / 16) * 8)));
            mma::mma_16816<T>(acc[2 * dp], a, bk[0], bk[1]);
            mma::mma_16816<T>(acc[2 * dp + 1], a, bk[2], bk[3]);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t row = m0 + 16 * warp + gr + 8 * r;
          if (row < p.seqlen_q) {  // the tile's rows past the end were zeros: nothing to add
#pragma unroll
            for (int d = 0; d < kDTiles; ++d) {
              atomicAdd(dq + row * kD + 8 * d + 2 * t, acc[d][2 * r]);
              atomicAdd(dq + row * kD + 8 * d + 2 * t + 1, acc[d][2 * r + 1]);
            }
          }
        }
      }
      // Every warp is done with this tile's Q, dO (and dS^T) before the next trip overwrites them.
      __syncthreads();
    }
  }

  // dK = scale dS^T Q and dV, summed over the group's query heads, once per key.
  const float scale = static_cast<float>(p.scale);
  T* dkp = static_cast<T*>(g.dk) + b * g.dk_batch_stride + hk * g.dk_head_stride;
  T* dvp = static_cast<T*>(g.dv) + b * g.dv_batch_stride + hk * g.dv_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = n0 + 16 * warp + gr + 8 * r;
    if (key < p.seqlen_k) {  // the last tile's keys past the end were zeros
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        *reinterpret_cast<uint32_t*>(dkp + key * g.dk_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(dk[d][2 * r] * scale, dk[d][2 * r + 1] * scale);
        *reinterpret_cast<uint32_t*>(dvp + key * g.dv_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(dv[d][2 * r], dv[d][2 * r + 1]);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800: older GPUs never launch it (the glue checks the capability)
}

// The deterministic dQ (rung "mma_dqpass"): FlashAttention 2's other option. A block owns 64
// query rows of one head, each warp 16 of them, and walks the key tiles as the forward does,
// recomputing S and P, and dP = dO V^T, then dQ_w += dS K in registers: one writer per dQ
// element, so no atomics and the same bits on every run, for a second pass over K and V.
//   S   = Q_w K^T    A: Q rows (ldmatrix)     B: K rows (ldmatrix, n-major)
//   dP  = dO_w V^T   A: dO rows (ldmatrix)    B: V rows (ldmatrix, n-major)
//   dS  = P * (dP - D),   P = exp2(S scale log2(e) - lse log2(e)), 0 where not visible
//   dQ += dS K       A: dS from the registers B: K (ldmatrix.trans, k-major)
template <typename T, typename K>
__global__ void __launch_bounds__(K::kThreads)
    flash_bwd_dq_kernel(const AttentionBackwardParams g, const float* __restrict__ d_rows, unsigned q_tiles,
                        float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kD = K::kHeadDim;
  constexpr int kNTiles = K::kBlockN / 8;
  constexpr int kDTiles = kD / 8;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionParams& p = g.fwd;
  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* do_s = q_s + K::kTileElems;
  T* k_s = do_s + K::kTileElems;
  T* v_s = k_s + K::kTileElems;

  const int64_t tile = blockIdx.x % q_tiles;
  const int64_t bh = blockIdx.x / q_tiles;
  const int64_t b = bh / p.heads;
  const int64_t h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.heads_kv);
  const int64_t m0 = tile * K::kBlockM;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gr = lane / 4;
  const int t = lane % 4;
  const int64_t row0 = m0 + warp * 16 + gr;
  const int64_t diag = p.seqlen_k - p.seqlen_q;

  const int64_t last_row = (m0 + K::kBlockM < p.seqlen_q ? m0 + K::kBlockM : p.seqlen_q) - 1;
  const int64_t n_keys = visible_keys(last_row, p.seqlen_q, p.seqlen_k, p.causal);
  const int n_tiles = static_cast<int>((n_keys + K::kBlockN - 1) / K::kBlockN);

  // This lane's two rows: lse in log2 units (+inf past the end or with no visible key, so that
  // P is 0 there) and D.
  float lse2[2];
  float dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + 8 * r;
    const float lse = row < p.seqlen_q ? static_cast<const float*>(p.lse)[bh * p.seqlen_q + row] : INFINITY;
    lse2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    dr[r] = row < p.seqlen_q ? d_rows[bh * p.seqlen_q + row] : 0.f;
  }
  float acc[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;

  if (n_tiles > 0) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
    const T* dout = static_cast<const T*>(g.dout) + b * g.do_batch_stride + h * g.do_head_stride;
    load_tile<K, K::kBlockM>(q_s, q, p.q_seq_stride, m0, p.seqlen_q);
    load_tile<K, K::kBlockM>(do_s, dout, g.do_seq_stride, m0, p.seqlen_q);
  }
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  for (int n = 0; n < n_tiles; ++n) {
    const int64_t n0 = static_cast<int64_t>(n) * K::kBlockN;
    load_tile<K, K::kBlockN>(k_s, k, p.k_seq_stride, n0, p.seqlen_k);
    load_tile<K, K::kBlockN>(v_s, v, p.v_seq_stride, n0, p.seqlen_k);
    // The tiles (Q and dO on the first trip too), visible to every warp.
    __syncthreads();

    float s[kNTiles][4];
    float dp[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
    }
    mma::gemm_nt<T, K, kD, K::kBlockN>(s, q_s, warp * 16, k_s, 0, lane);
    mma::gemm_nt<T, K, kD, K::kBlockN>(dp, do_s, warp * 16, v_s, 0, lane);
    // dS in place of dP: element [j][e] is row row0 + 8(e / 2), key n0 + 8j + 2t + e % 2.
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = n0 + 8 * j + 2 * t + e % 2;
        const int64_t row = row0 + 8 * (e / 2);
        const bool visible = key < p.seqlen_k && (!p.causal || key <= row + diag);
        const float pr = visible ? exp2f(s[j][e] * scale_log2 - lse2[e / 2]) : 0.f;
        dp[j][e] = pr * (dp[j][e] - dr[e / 2]);
      }
    }
    mma::gemm_rs<T, K, K::kBlockN, kD>(acc, dp, k_s, 0, lane);
    // Every warp is done with K and V before the next trip overwrites them.
    __syncthreads();
  }

  const float scale = static_cast<float>(p.scale);
  T* dqp = static_cast<T*>(g.dq) + b * g.dq_batch_stride + h * g.dq_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + 8 * r;
    if (row < p.seqlen_q) {
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        *reinterpret_cast<uint32_t*>(dqp + row * g.dq_seq_stride + 8 * d + 2 * t) =
            mma::pack2<T>(acc[d][2 * r] * scale, acc[d][2 * r + 1] * scale);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, int D>
cudaError_t run_flash_bwd(const AttentionBackwardParams& g, float* dq_accum, const float* d_rows,
                          cudaStream_t stream) {
  using K = BwdTraits<D>;
  const AttentionParams& p = g.fwd;
  const float scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  const int64_t k_tiles = course::ceil_div(p.seqlen_k, static_cast<int64_t>(K::kBlockN));
  const int64_t blocks = k_tiles * p.batch * p.heads_kv;
  const int64_t q_tiles = course::ceil_div(p.seqlen_q, static_cast<int64_t>(K::kBlockM));
  const int64_t dq_blocks = q_tiles * p.batch * p.heads;
  if (blocks > INT_MAX || dq_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (blocks > 0) {
    // The dQ sums (dq_accum non-null: rung "mma") or not (rung "mma_dqpass").
    auto kernel = dq_accum != nullptr ? flash_bwd_kernel<T, K, true> : flash_bwd_kernel<T, K, false>;
    COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
    kernel<<<static_cast<unsigned>(blocks), K::kThreads, K::kSmemBytes, stream>>>(
        g, dq_accum, d_rows, static_cast<unsigned>(k_tiles), scale_log2);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  if (dq_accum == nullptr && dq_blocks > 0) {
    auto kernel = flash_bwd_dq_kernel<T, K>;
    COURSE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
    kernel<<<static_cast<unsigned>(dq_blocks), K::kThreads, K::kSmemBytes, stream>>>(
        g, d_rows, static_cast<unsigned>(q_tiles), scale_log2);
    COURSE_CUDA_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace flash_attention
