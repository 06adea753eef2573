// Hopper's asynchronous machinery, one small named wrapper per PTX instruction, each with why it
// is there. Everything a chapter 6 part 3 kernel (and experiments/hopper_gemm.cu) issues that
// CUDA C++ has no word for lives here, so that the kernels read as the algorithm.
//
//   TMA       the tensor memory accelerator: one thread asks for a whole tile
//             (cp.async.bulk.tensor) described by a CUtensorMap made on the host; the copy engine
//             writes it into shared memory, swizzled, and zero-fills what lies outside the tensor.
//   mbarrier  a barrier object in shared memory that counts arrivals *and* bytes: the TMA unit
//             "arrives" with the bytes it wrote (complete_tx), so waiting on it means "the tile is
//             there". It flips a phase bit each time it completes; waiters name the parity they
//             wait for, so one barrier serves every trip around a ring of stages.
//   wgmma     a matrix product issued by a warpgroup (4 consecutive warps, 128 threads) and run
//             asynchronously by the tensor cores: B (and A, or A from registers) read straight
//             from shared memory through a 64-bit descriptor, accumulators in registers. Issue,
//             commit a group, and wait for groups later: the warps can compute meanwhile.
//   setmaxnreg  moves registers between warpgroups of one block: a producer that only issues
//             copies gives its registers to the consumers that hold the accumulators.
//
// sm_90a only (wgmma and setmaxnreg need the "a" target; TMA and mbarrier would run on any
// sm_90). The callers compile these only under COURSE_HOPPER_DEVICE (below), so the same source
// builds, empty, for sm_75 and sm_80.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; no driver library is linked for it)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

// True in the device pass for sm_90a, the only target whose code may issue these instructions.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define COURSE_HOPPER_DEVICE 1
#else
#define COURSE_HOPPER_DEVICE 0
#endif

namespace hopper {

#if COURSE_HOPPER_DEVICE

// The 32-bit shared-memory address every shared::cta operand takes.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory from its first 1024-byte boundary (the period of the 128-byte
// swizzle's pattern, which the descriptors and tensor maps assume). Written as an offset added to
// the array, not as the array's address rounded through an integer: a pointer rebuilt from an
// integer has lost its address space, and the compiler then reaches every buffer carved from it
// with generic loads and stores (LD.E / ST.E in the SASS), which wait on the long scoreboard like
// global memory does. The backward's statistics loads and its dS stores did (NOTES.md, "Short
// sequences and the backward, read with ncu").
__device__ __forceinline__ unsigned char* smem_aligned_1024(unsigned char* smem_raw) {
  return smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
}

// ------------------------------------------------------------------------------------------
// mbarrier
// ------------------------------------------------------------------------------------------
// `count` arrivals complete a phase (besides the transaction bytes expected on it).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// The initialised barriers must be visible to the copy engine (another proxy) before any copy
// completes on them; a __syncthreads() after this publishes them to the block's threads.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also tells the barrier to expect `bytes` more from the copy engine: the phase
// completes when the arrivals are in *and* the bytes have landed.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// An arrival that fires once every cp.async this thread issued before it has landed (the 16-byte
// copies of mma.cuh's cp_async_16, not the bulk ones): the phase then completes with the data in
// shared memory, no wait_group in the issuing thread. .noinc: the arrival is one of the `count` the
// barrier was initialised with (without it the instruction adds one to the pending count first, and
// a barrier counted for these arrivals alone would never complete).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// A hint: bring the line holding `ptr` (a valid global address) into L1, nothing waits for it.
__device__ __forceinline__ void prefetch_global_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}
// a x b + c, 32 x 32 bits to 64 plus 64: one IMAD.WIDE.U32, the paged gather's address step. Written
// in C++, the compiler may first add a to another 32-bit term of the sum in 64 bits (five
// instructions in front of every page's copies); in PTX the product is added as written.
__device__ __forceinline__ uint64_t mad_wide_u32(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}
// Wait until the phase with this parity has completed. try_wait suspends the thread for a
// while inside the instruction before it reports "not yet", so the loop does not hammer shared
// memory. Parity, not a phase count: trip n of a ring of S stages waits for parity (n / S) & 1.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  }
}

// ------------------------------------------------------------------------------------------
// TMA: tiles from global to shared memory, completing on an mbarrier
// ------------------------------------------------------------------------------------------
// The tensor map lives in kernel parameter space (a __grid_constant__ parameter): its generic
// address is what the instruction takes. Coordinates are in elements, innermost first; rows
// outside the tensor arrive as zeros (attention relies on it for the last, partial tile).
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}
// The same box, brought into L2 only (no shared memory, no barrier): a hint that a later tma_load_4d
// of it finds it there. A box may reach past the tensor's end, as for the loads (nothing is fetched
// there).
__device__ __forceinline__ void tma_prefetch_l2_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// A plain (non-tensor) bulk copy of `bytes` contiguous bytes, completing on `bar` like the tiles:
// both addresses 16-byte aligned, `bytes` a multiple of 16, and nothing outside the source may be
// named (no tensor map, so no zero-fill: the backward pads its per-row statistics to whole tiles).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// The other direction, as a reduction: the copy engine reads `bytes` contiguous bytes of shared
// memory and adds them as floats into global memory (atomically per element, like RED.ADD), so
// several blocks may sum into the same place. Both addresses 16-byte aligned, `bytes` a multiple
// of 16. It completes in a bulk group of the issuing thread (commit, then wait below), not on an
// mbarrier; the shared source must not be written again before the group's reads are done.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<uint64_t>(dst)),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
// Closes the issuing thread's bulk operations since the last commit into one group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most kPending of the thread's groups still read their shared source (the buffer
// may be written again), or, without .read, until at most kPending are complete in global memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}
// Shared memory written by ordinary stores and read next by wgmma (the async proxy): each writing
// thread fences its stores into the async proxy's view before the barrier that hands them over
// (the same for shared memory that a bulk copy or reduction reads next).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ------------------------------------------------------------------------------------------
// wgmma: descriptors, fences, groups
// ------------------------------------------------------------------------------------------
// A shared-memory matrix descriptor for a tile stored with the 128-byte swizzle (what TMA writes
// with CU_TENSOR_MAP_SWIZZLE_128B): rows of 64 16-bit elements (128 bytes), 8 rows to a 1024-byte
// swizzle atom, atoms 1024-byte aligned.
//   K-major operand (the reduction dim contiguous: Q and K for S = Q K^T): `sbo` = 1024, the
//     stride from one 8-row group to the next; `lbo` is unused. Step k16 of a 64-wide row
//     advances the start address by 32 bytes: the hardware applies the swizzle to the full
//     address, so a start inside an atom reads the right chunks.
//   MN-major operand (V for O = P V: the keys are the reduction dim, the head dim contiguous):
//     `lbo` = the stride between 64-wide column chunks, `sbo` = 1024 between 8-row groups of keys;
//     wgmma is told to transpose it (tnspB = 1), which 16-bit types allow.
// Bits: start address >> 4 in 0-13, lbo >> 4 in 16-29, sbo >> 4 in 32-45, swizzle mode in 62-63
// (1 = 128 bytes); the base offset (49-51) stays 0 because every atom is 1024-byte aligned.
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* start, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = (smem_addr(start) & 0x3FFFFu) >> 4;
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32;
  desc |= 1ull << 62;
  return desc;
}
// The descriptor of the same buffer `bytes` further on (a multiple of 16). The start address is
// bits 0-13 of the descriptor in 16-byte units, and shared memory (under 228 KiB, 0x3900 units)
// never carries out of them, so one 32-bit add on the low word moves it: a kernel builds each
// buffer's descriptor once, where building it from a pointer each step (mask, shift, or, the
// constant high word, per instruction) took ~50 uniform-datapath instructions per key tile of the
// issue slots the softmax needs (the FP8 forward's, NOTES.md; the bf16 overlap's descriptors too).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}
// An empty statement that "redefines" x: the compiler can no longer treat it as the loop-invariant
// value it is, so it builds it again where it is used instead of keeping it live (register pressure).
__device__ __forceinline__ void opaque(uint64_t& x) { asm volatile("" : "+l"(x)); }
// The same for a tile whose rows are 64 bytes, stored with the 64-byte swizzle (what TMA writes
// with CU_TENSOR_MAP_SWIZZLE_64B: the FP8 forward's Q and K at head_dim 64, a row of 64 one-byte
// elements): 8 rows to a 512-byte atom, so `sbo` = 512 for a K-major operand; swizzle mode 2 in bits
// 62-63. A k32 step is again 32 bytes further inside the row.
__device__ __forceinline__ uint64_t smem_desc_sw64(const void* start, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = (smem_addr(start) & 0x3FFFFu) >> 4;
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32;
  desc |= 2ull << 62;
  return desc;
}
// Registers that a wgmma reads or writes must not be touched by ordinary instructions between
// its issue and the wait for its group; the fence orders the accumulators' last ordinary writes
// before the asynchronous reads.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most `kPending` committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// The compiler sees a wgmma's accumulators as written when it issues, not when its group
// completes: this empty statement "uses and redefines" each one, so no read of them is moved
// above the wait (after it) or write below the issue (before it). CUTLASS does the same.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments held in registers (wgmma_rs reads them asynchronously too: without
// this the compiler may reuse their registers for temporaries before the product has read them).
template <int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// ------------------------------------------------------------------------------------------
// wgmma.mma_async m64nNk16, float32 accumulators
// ------------------------------------------------------------------------------------------
// d: the warpgroup's 64 x N accumulator tile, N / 2 floats per thread in mma.sync's C layout
// (warp w of the group holds rows 16w..16w+15; register i is row g + 8 * ((i >> 1) & 1), column
// 8 * (i >> 2) + 2t + (i & 1), with g = lane / 4, t = lane % 4). accumulate = 0 overwrites d.
//   ss: A (64 x 16) and B (N x 16) both from shared memory, A K-major unless kTransA (MN-major,
//       read transposed: the backward's dS, stored as dS^T), B transposed if kTransB.
//   rs: A from registers in mma.sync's A layout (4 x 32 bits: rows g and g + 8, columns
//       2t, 2t + 1 and 2t + 8, 2t + 9), B from shared memory, transposed if kTransB.
// Inline assembly takes only literal strings, hence the operand lists written out.
#define COURSE_WGMMA_D32                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define COURSE_WGMMA_D64                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define COURSE_WGMMA_D88                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87}"
#define COURSE_WGMMA_D128                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
  "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, "  \
  "%106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
  "%124, %125, %126, %127}"
#define COURSE_F8(i)                                                                                   \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define COURSE_F32(i) COURSE_F8(i), COURSE_F8(i + 8), COURSE_F8(i + 16), COURSE_F8(i + 24)
#define COURSE_F64 COURSE_F32(0), COURSE_F32(32)
#define COURSE_F88 COURSE_F64, COURSE_F8(64), COURSE_F8(72), COURSE_F8(80)
#define COURSE_F128 COURSE_F64, COURSE_F32(64), COURSE_F32(96)

// The instruction for element type T (bfloat16 or float16) and width N, as static members so that
// the kernels name them Wgmma<T, N>::ss(...) and Wgmma<T, N>::rs<kTransB>(...). The operand
// numbers after the accumulators (A, B, ...) are written out per N: inline assembly cannot add.
template <typename T, int N>
struct Wgmma;

#define COURSE_WGMMA(CTYPE, TY, N, REGS, DLIST, SA, SB, SP, ST, STA, RA0, RA1, RA2, RA3, RB, RP, RT)            \
  template <>                                                                                                 \
  struct Wgmma<CTYPE, N> {                                                                                    \
    template <int kTransB = 0, int kTransA = 0>                                                               \
    __device__ static __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,              \
                                              int accumulate) {                                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SP ", 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" #SA ", %" #SB   \
                   ", p, 1, 1, %" #STA ", %" #ST ";\n}\n"                                                     \
                   : DLIST                                                                                    \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB), "n"(kTransA));                 \
    }                                                                                                         \
    template <int kTransB>                                                                                    \
    __device__ static __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,       \
                                              int accumulate) {                                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #RP ", 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" #RA0 ", %" #RA1 \
                   ", %" #RA2 ", %" #RA3 "}, %" #RB ", p, 1, 1, %" #RT ";\n}\n"                                  \
                   : DLIST                                                                                    \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB));  \
    }                                                                                                         \
  };

#define COURSE_WGMMA_WIDTHS(CTYPE, TY)                                                                         \
  COURSE_WGMMA(CTYPE, TY, 64, COURSE_WGMMA_D32, COURSE_F32(0), 32, 33, 34, 35, 36, 32, 33, 34, 35, 36, 37, 38)          \
  COURSE_WGMMA(CTYPE, TY, 128, COURSE_WGMMA_D64, COURSE_F64, 64, 65, 66, 67, 68, 64, 65, 66, 67, 68, 69, 70)            \
  COURSE_WGMMA(CTYPE, TY, 176, COURSE_WGMMA_D88, COURSE_F88, 88, 89, 90, 91, 92, 88, 89, 90, 91, 92, 93, 94)            \
  COURSE_WGMMA(CTYPE, TY, 256, COURSE_WGMMA_D128, COURSE_F128, 128, 129, 130, 131, 132, 128, 129, 130, 131, 132, 133, 134)

COURSE_WGMMA_WIDTHS(__nv_bfloat16, "bf16")
COURSE_WGMMA_WIDTHS(__half, "f16")
#undef COURSE_WGMMA_WIDTHS
#undef COURSE_WGMMA

// ------------------------------------------------------------------------------------------
// wgmma.mma_async m64nNk32, e4m3 x e4m3, float32 accumulators (the FP8 forward)
// ------------------------------------------------------------------------------------------
// The same accumulator layout as above (it does not depend on the input type); what changes is the
// reduction step, 32 one-byte elements (32 bytes of a K-major row, as k16 was for 16-bit types),
// and that both operands must be K-major: 8-bit wgmma has no transpose (no imm-trans operands), so
// O = P V reads V^T (head_dim rows, keys contiguous).
//   ss: A (64 x 32) and B (N x 32) from shared memory.
//   rs: A from registers: 4 x 32 bits, four e4m3 per register, lowest k in the lowest byte:
//       a0 = row g, k 4t..4t+3;  a1 = row g + 8, k 4t..4t+3;
//       a2 = row g, k 16+4t..16+4t+3;  a3 = row g + 8, k 16+4t..16+4t+3
//       (the PTX ISA's "wgmma .m64nNk32 register fragment layout for matrix A": mma.sync's
//       m16n8k32 8-bit A layout, per warp of the group; CuTe's ALayout_64x32 decodes to the same:
//       k = 4t + byte + 16 (reg >> 1), row g + 8 (reg & 1)). flash_fwd_hopper_fp8.cuh's pack_p_fp8 has
//       how P's accumulators get there.
template <int N>
struct WgmmaFp8;

#define COURSE_WGMMA_FP8(N, REGS, DLIST, SA, SB, SP, RA0, RA1, RA2, RA3, RB, RP)                                   \
  template <>                                                                                                 \
  struct WgmmaFp8<N> {                                                                                        \
    __device__ static __forceinline__ void ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,              \
                                              int accumulate) {                                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SP ", 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", %" #SA ", %" #SB         \
                   ", p, 1, 1;\n}\n"                                                                           \
                   : DLIST                                                                                    \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                              \
    }                                                                                                         \
    __device__ static __forceinline__ void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,       \
                                              int accumulate) {                                               \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #RP ", 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " REGS ", {%" #RA0 ", %" #RA1      \
                   ", %" #RA2 ", %" #RA3 "}, %" #RB ", p, 1, 1;\n}\n"                                           \
                   : DLIST                                                                                    \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));               \
    }                                                                                                         \
  };

COURSE_WGMMA_FP8(64, COURSE_WGMMA_D32, COURSE_F32(0), 32, 33, 34, 32, 33, 34, 35, 36, 37)
COURSE_WGMMA_FP8(128, COURSE_WGMMA_D64, COURSE_F64, 64, 65, 66, 64, 65, 66, 67, 68, 69)
#undef COURSE_WGMMA_FP8

// ------------------------------------------------------------------------------------------
// Registers, named barriers, the exponential
// ------------------------------------------------------------------------------------------
// Give registers back (a producer warpgroup that only issues copies) or take them (consumers
// holding accumulators). Takes effect only when the kernel starts under a register cap
// (__launch_bounds__(threads, 1)) and each warpgroup's role is one branch; ptxas says so (C7508)
// when it ignores it. The counts are per thread, multiples of 8, from 24 to 256.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
// Hardware barriers 1..15 for subsets of the block (0 is __syncthreads): `threads` counts every
// thread that syncs or arrives on it. sync waits; arrive signals and goes on (the ping-pong of
// two consumer warpgroups hands the tensor cores back and forth with these).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// 2^x on the special-function unit, one MUFU.EX2. exp2f without fast-math compiles to that plus
// a compare and two predicated multiplies that keep results below 2^-126 exact; softmax weights
// that small are far below bfloat16's resolution next to the row's largest (which is 1), so the
// flush to zero (ftz) and the instruction's 2-ulp error are invisible in the output.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#endif  // COURSE_HOPPER_DEVICE
}  // namespace hopper
