// The tensor-core building blocks of the mma rungs, each one PTX instruction, with the register
// layouts the PTX ISA defines for them (PTX ISA, "Warp-level matrix fragments" for mma.m16n8k16,
// and "ldmatrix"). Every layout below is what the kernels in flash_fwd_kernel.cuh rely on when
// they hand one instruction's output to the next without a trip through shared memory.
//
// Notation: a warp's 32 lanes; g = lane / 4 (the "group", 0..7) and t = lane % 4 (0..3).
//
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D (16x8, f32) = A (16x16) B (16x8) + C.
//
//   A, row-major 16x16, four 32-bit registers of two 16-bit elements (low half = lower column):
//              cols 0..7            cols 8..15
//     rows 0..7   a0: (g, 2t..2t+1)   a2: (g, 8+2t..)
//     rows 8..15  a1: (g+8, 2t..)     a3: (g+8, 8+2t..)
//
//   B, 16x8 (k x n) "col": two registers; b0 = B[2t..2t+1][g], b1 = B[8+2t..8+2t+1][g]:
//     each lane holds two k-adjacent elements of column g.
//
//   C and D, 16x8 float32, four registers:
//     c0, c1 = (g, 2t), (g, 2t+1)        c2, c3 = (g+8, 2t), (g+8, 2t+1)
//
// The identity FlashAttention 2 is built on: the C layout of two adjacent n8 tiles (columns
// 0..7 and 8..15) is, register for register, the A layout of one 16x16 tile: a0 = (c0, c1) of
// the first tile, a1 = (c2, c3) of the first, a2 = (c0, c1) of the second, a3 = (c2, c3) of the
// second. So S = Q K^T, computed as C fragments, becomes P, the A operand of P V, by rounding
// to 16 bits in registers: no shared memory, no shuffle.
//
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8x8 matrices of 16-bit elements from
// shared memory. Lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes each) of matrix i;
// register ri receives matrix i. Without .trans lane l holds row l / 4, columns 2(l % 4) and
// 2(l % 4) + 1, which is the A layout (matrices: rows 0-7 x cols 0-7, rows 8-15 x cols 0-7,
// rows 0-7 x cols 8-15, rows 8-15 x cols 8-15) and, for a matrix stored n-major (K: a key's d
// values contiguous), the B layout. With .trans lane l holds rows 2(l % 4), 2(l % 4) + 1 of
// column l / 4: the B layout for a matrix stored k-major (V: a key's d values contiguous, keys
// being P V's k dimension).
//
// cp.async.cg.shared.global (16 bytes): a copy from global to shared memory that does not
// occupy registers and does not block the thread; commit_group closes a batch of them and
// wait_group N waits until at most N batches are still in flight. A source size of 0 writes 16
// zero bytes and reads nothing: the rows past a sequence's end.
//
// All of it needs sm_80 (mma.m16n8k16 in bf16, cp.async); the callers compile these only for
// __CUDA_ARCH__ >= 800 and the glue refuses older GPUs with a message.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flash_attention {
namespace mma {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a b for one m16n8k16 tile; T (__nv_bfloat16 or __half) names the input type.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_16816 takes bfloat16 or float16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kInFlight>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kInFlight));
}

#endif  // __CUDA_ARCH__ >= 800

// Two floats rounded to one 32-bit register of two 16-bit T, lo in the low half (the lower
// column of an A fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  }
  return bits;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// The two warp-level products every tensor-core kernel of the chapter is made of (FlashAttention
// 2 calls them gemm and gemm_rs). Tiles are 16-bit, in shared memory, one row per token with the
// head dim contiguous (Q, K, V, dO as they are stored), addressed through L::offset(row, col)
// (padded or swizzled: flash_fwd.h); accumulators are float32 C fragments, acc[j] the n8 tile of
// columns 8j..8j+7.
//
// gemm_nt: acc[m] (16 x kN) += A_m B^T for kMT row tiles m, A_m = rows a_row + 16m .. +15 of
// tile a, B = rows b_row..b_row+kN-1 of tile b, both over kK columns. The S = Q K^T shape: A
// through ldmatrix (matrices rows 0-7 / 8-15 x cols 0-7 / 8-15), B through ldmatrix as well, since
// a row of b is a column of B^T (matrices: rows 0-7 x cols 0-7 -> b0 of tile 2j, cols 8-15 -> b1,
// rows 8-15 -> tile 2j + 1). With kMT > 1 each B fragment read from shared memory feeds kMT
// mma instructions: a warp owning 32 rows reads K once per 32 rows instead of once per 16, which
// halves the shared-memory bytes per tensor-core FLOP (the tuned forward rung).
template <typename T, typename L, int kK, int kN, int kMT>
__device__ __forceinline__ void gemm_nt(float (&acc)[kMT][kN / 8][4], const T* a, int a_row, const T* b,
                                        int b_row, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[kMT][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
      ldmatrix_x4(af[m], smem_address(a + L::offset(a_row + 16 * m + lane % 16, kk * 16 + (lane / 16) * 8)));
    }
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) {
      uint32_t bf[4];
      ldmatrix_x4(bf, smem_address(b + L::offset(b_row + j * 16 + lane % 8 + (lane / 16) * 8,
                                                 kk * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        mma_16816<T>(acc[m][2 * j], af[m], bf[0], bf[1]);
        mma_16816<T>(acc[m][2 * j + 1], af[m], bf[2], bf[3]);
      }
    }
  }
}

// One row tile (16 x kN): the shape of every warp of the backward and of the first two forward
// rungs.
template <typename T, typename L, int kK, int kN>
__device__ __forceinline__ void gemm_nt(float (&acc)[kN / 8][4], const T* a, int a_row, const T* b, int b_row,
                                        int lane) {
  gemm_nt<T, L, kK, kN, 1>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc), a, a_row, b, b_row, lane);
}

// gemm_rs: acc[m] (16 x kN) += A_m B, A_m (16 x kK) in registers as the C fragments s[m] of an
// earlier product (rounded to T here: the C-to-A identity above), B = rows b_row..b_row+kK-1 of
// tile b, its first kN columns. The O += P V shape: B's k runs down the tile's rows, so
// ldmatrix.trans (matrices: rows 0-7 x cols 0-7 -> b0 of tile 2j, rows 8-15 -> b1, cols 8-15 ->
// tile 2j + 1). As in gemm_nt, each B fragment serves kMT row tiles.
template <typename T, typename L, int kK, int kN, int kMT>
__device__ __forceinline__ void gemm_rs(float (&acc)[kMT][kN / 8][4], const float (&s)[kMT][kK / 8][4], const T* b,
                                        int b_row, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[kMT][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
      af[m][0] = pack2<T>(s[m][2 * kk][0], s[m][2 * kk][1]);
      af[m][1] = pack2<T>(s[m][2 * kk][2], s[m][2 * kk][3]);
      af[m][2] = pack2<T>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
      af[m][3] = pack2<T>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
    }
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, smem_address(b + L::offset(b_row + kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                       j * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int m = 0; m < kMT; ++m) {
        mma_16816<T>(acc[m][2 * j], af[m], bf[0], bf[1]);
        mma_16816<T>(acc[m][2 * j + 1], af[m], bf[2], bf[3]);
      }
    }
  }
}

template <typename T, typename L, int kK, int kN>
__device__ __forceinline__ void gemm_rs(float (&acc)[kN / 8][4], const float (&s)[kK / 8][4], const T* b,
                                        int b_row, int lane) {
  gemm_rs<T, L, kK, kN, 1>(reinterpret_cast<float(&)[1][kN / 8][4]>(acc),
                           reinterpret_cast<const float(&)[1][kK / 8][4]>(s), b, b_row, lane);
}

#endif  // __CUDA_ARCH__ >= 800

}  // namespace mma
}  // namespace flash_attention
