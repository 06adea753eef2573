// Torch glue for the training half (attention.h): the schemas of attention_forward and
// attention_backward, their input checks, the CPU/CUDA/Meta kernels, the autograd Function and
// registration with the dispatcher (chapter 5's pattern: every piece declared to the dispatcher,
// so torch.compile traces forward and backward without a graph break and torch.library.opcheck
// can test each piece against the others). The `flash_attention` library itself is defined in
// flash_attention_ops.cpp; these ops join it with TORCH_LIBRARY_FRAGMENT.
//
// One implementation per op serves every backend and picks the backend from the (already
// checked) device, so the checks cannot drift apart between backends. Inputs are passed by
// strides, never copied: only the last dim must be contiguous.
#include "attention/attention.h"
#include "attention/attention_params.h"
#include "flash_attention_ops.h"
#include "hopper/tile_schedule.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/dispatch.h>
#include <course/on_cuda.h>
#include <course/versions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>

#ifdef WITH_CUDA
#include "hopper/flash_bwd_hopper.h"
#include "hopper/flash_fwd_hopper.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace flash_attention {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::is_listed;
using ::course::list_text;
using ::course::OptVersion;
using ::course::shape_of;

constexpr const char* kForward = "attention_forward";
constexpr const char* kBackward = "attention_backward";

// The ladders. The CPU reference is not a rung: it is what the rungs are held to, and it runs
// whatever version= names (the names are parsed on every device, so a typo fails on the CPU as
// it would on CUDA).
enum class ForwardVersion {
  kNaive, kTiled, kMma, kPipelined, kTuned, kSplitKv, kWgmma, kWarpSpecialized, kPingpong, kPersistent
};
enum class BackwardVersion { kNaive, kMma, kMmaDqPass, kWgmma };

constexpr ::course::NamedVersion<ForwardVersion> kForwardVersions[] = {{"naive", ForwardVersion::kNaive},
                                                                      {"tiled", ForwardVersion::kTiled},
                                                                      {"mma", ForwardVersion::kMma},
                                                                      {"pipelined", ForwardVersion::kPipelined},
                                                                      {"tuned", ForwardVersion::kTuned},
                                                                      {"split_kv", ForwardVersion::kSplitKv},
                                                                      {"wgmma", ForwardVersion::kWgmma},
                                                                      {"warp_specialized", ForwardVersion::kWarpSpecialized},
                                                                      {"pingpong", ForwardVersion::kPingpong},
                                                                      {"persistent", ForwardVersion::kPersistent}};
constexpr ::course::NamedVersion<BackwardVersion> kBackwardVersions[] = {
    {"naive", BackwardVersion::kNaive},
    {"mma", BackwardVersion::kMma},
    {"mma_dqpass", BackwardVersion::kMmaDqPass},
    {"wgmma", BackwardVersion::kWgmma}};  // part 3's (csrc/hopper/flash_bwd_hopper.h)

bool tensor_core_rung(ForwardVersion v) {
  return v == ForwardVersion::kMma || v == ForwardVersion::kPipelined || v == ForwardVersion::kTuned ||
         v == ForwardVersion::kSplitKv;
}
// Part 3's rungs (csrc/hopper/): sm_90a only.
bool hopper_rung(ForwardVersion v) {
  return v == ForwardVersion::kWgmma || v == ForwardVersion::kWarpSpecialized || v == ForwardVersion::kPingpong ||
         v == ForwardVersion::kPersistent;
}

#ifdef WITH_CUDA
// The tensor-core rungs by name, for the checks, which know the version by its name ("split_kv"
// runs the tuned kernel when it does not split, and the tuned kernel's shared memory is the larger).
MmaForward mma_rung(const std::string& name) {
  return name == "mma" ? MmaForward::kMma : name == "pipelined" ? MmaForward::kPipelined : MmaForward::kTuned;
}
HopperForward hopper_kind(ForwardVersion v) {
  return v == ForwardVersion::kWgmma              ? HopperForward::kWgmma
         : v == ForwardVersion::kWarpSpecialized ? HopperForward::kWarpSpecialized
         : v == ForwardVersion::kPingpong        ? HopperForward::kPingpong
                                                 : HopperForward::kPersistent;
}
#endif

bool half_dtype(const Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// version=None: the fastest forward rung that runs. On a Hopper GPU (compute capability 9.0, in a
// build with the sm_90a kernels) that is part 3's. At head_dim 64 and 128 "pingpong" (where its third
// shared-memory stage fits) or "persistent", which runs the same consumers in a grid of one block
// per SM that draws its tiles longest first. It gains two ways: it saves each tile's start and end
// (the Q load, the output's store), a fixed cost per tile that matters while the tile's walk over
// the keys is short, and it balances walks of different lengths (causal tiles), which the plain
// grid leaves to chance in its last wave; it pays 8 registers per consumer thread (232 instead of
// 240) and an atomic per tile, and it keeps the joint schedule, where "pingpong" runs FlashAttention
// 3's intra-warpgroup overlap (flash_fwd_hopper.h: the overlap's consumers spill at 232). So the
// persistent grid pays while a tile's fixed cost or the walks' imbalance outweighs the overlap's
// gain per key tile, which grows with the walk. At d = 64 the persistent rung runs the overlap too
// (hopper_forward_overlap): the same consumers, so only the grid differs, and the bounds are longer.
// The H200 benchmark at 2c403b4 (both rungs timed at every sweep shape in shuffled rounds, both
// 16-bit types; pingpong's time over persistent's): d = 128 full rows (every walk alike) +4 to +7%
// at 512 keys, -1 to -2% at 1024, -5 to -7% from 2048; causal rows (walks from 1 key to all of
// them) +11% at 512, +2% at 4096, 0 to +0.3% at 8192, -5% at 16384. d = 64 full +16% at 512, +3% at
// 2048, +0.4% at 4096, -0.7% at 8192; causal +18% at 512, +3% at 8192, -0.3 to -1.1% at 16384. So
// "persistent" where the longest walk is at most persistent_bounds(head_dim).even_keys, or its
// uneven_keys when the walks are uneven (the shortest at most half the longest), and "pingpong"
// otherwise: each bound the last length where the persistent grid was ahead in both types. (The
// bounds before, one pair for both head dims from the fixed-order timing at e0364aa: 1024 and 4096;
// before the overlap, 2048 and unbounded.) At 256
// "warp_specialized", where the third stage does not fit and two stages leave ping-pong slower
// (experiments/hopper_forward_check.cu --variants, NOTES.md). A window or a softcap takes
// "persistent" there too, at head_dim 64 and 128 (kHopperWindowHeadDims: its kWindowSoftcap
// instantiation), whatever the walks: a sliding window's walks are short (about (128 + w) / 128 key
// tiles), which is where the persistent grid pays most, and part 1's "split_kv" ran it at 0.58x
// flex_attention on an H200 (README, window section). Elsewhere, and
// wherever the Hopper rungs do not apply (other head dims, a scale <= 0) it is "split_kv" (16-bit
// inputs on sm_80 and newer), else "tiled", which moves O(seqlen) bytes where "naive" moves
// O(seqlen^2). Each tensor-core rung of part 1 beats the one before at every seqlen, head_dim and
// mask measured, and "split_kv" is "tuned" wherever the grid fills the GPU: when it would split
// (attention_forward_splits > 1: a few query rows against many keys) it also wins over the Hopper
// rungs, whose 128-row tiles would run mostly empty.
//
// The backward: on a Hopper GPU (a build with the sm_90a kernels) "wgmma" at head_dim 64 and 128,
// which ran 2.3-2.6x "mma_dqpass" at the lesson's shapes on an H200 (bench_attention.py's backward
// rows). Elsewhere "mma_dqpass", which matched or beat "mma" (atomics) at every head_dim, mask and
// seqlen of the sweep once both were pipelined. "wgmma" adds dQ up with float32 bulk reductions and
// "mma" with float32 atomics, each in an order that changes from run to run; "mma_dqpass" gives the
// same bits on every run. So under torch.use_deterministic_algorithms(True) the rule keeps
// "mma_dqpass" (as FlashAttention's deterministic flag does). A window or a softcap takes "wgmma"
// too, at the same head dims (its kWindowSoftcap instantiation): part 1's "mma_dqpass" ran them at
// 0.41x (window (4095, 0) at 32768 keys, an H100) and 0.61x (softcap 30, an H200) flex_attention,
// and the Hopper rung's block walks only the query tiles its keys' windows reach, as "mma_dqpass"'s
// does.
#ifdef WITH_CUDA
// One attribute of q's GPU (cudaDeviceGetAttribute is a lookup, not a driver round trip).
int device_attribute(const Tensor& q, cudaDeviceAttr attr) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, q.device().index()));
  return value;
}
#endif

// What version=None reads about the machine, and the rule it follows with it: pure functions, so
// that flash_attention.default_choice can say which rung a call runs and the tests can hold the
// rule to any GPU (a made-up SM count, a Hopper or not) on any machine, this one included.
struct DispatchFacts {
  bool cuda = false, half = false;
  int cc_major = 0, cc_minor = 0, sms = 0;
  bool hopper_built = false;
};
// Whether the persistent grid pays (the version=None section above): the walks of a bottom-right
// aligned causal call run from seqlen_k - seqlen_q + 1 keys (at least 0) to seqlen_k; a full call's
// are all seqlen_k.
struct PersistentBounds {
  int64_t even_keys, uneven_keys;  // the longest walk at which the persistent grid pays
};
constexpr PersistentBounds persistent_bounds(int64_t head_dim) {
  return head_dim == 64 ? PersistentBounds{4096, 8192} : PersistentBounds{512, 4096};
}
bool persistent_pays(const AttentionParams& p) {
  const int64_t longest = p.seqlen_k;
  const int64_t shortest = p.causal ? std::max<int64_t>(0, p.seqlen_k - p.seqlen_q + 1) : p.seqlen_k;
  const PersistentBounds bounds = persistent_bounds(p.head_dim);
  return longest <= (2 * shortest <= longest ? bounds.uneven_keys : bounds.even_keys);
}
// A window or a softcap (attention.h) runs on "persistent" at kHopperWindowHeadDims (a Hopper GPU)
// and on "tuned" and "split_kv" (every GPU from sm_80: their kernel computes them); on a GPU that
// cannot run those it gets "tiled", which refuses it with the way out.
ForwardVersion forward_rule(const AttentionParams& p, const DispatchFacts& f) {
  if (!(f.cuda && f.half && f.cc_major >= 8)) return ForwardVersion::kTiled;
  const bool featured = uses_window_or_softcap(p);
  if (f.hopper_built && f.cc_major == 9 && f.cc_minor == 0 &&
      (featured ? is_listed(kHopperWindowHeadDims, p.head_dim) : is_listed(kHopperHeadDims, p.head_dim)) &&
      p.scale > 0.0 &&
      attention_forward_splits(p, f.sms) == 1) {
    if (featured) return ForwardVersion::kPersistent;
    if (p.head_dim > 128) return ForwardVersion::kWarpSpecialized;
    return persistent_pays(p) ? ForwardVersion::kPersistent : ForwardVersion::kPingpong;
  }
  return ForwardVersion::kSplitKv;
}
BackwardVersion backward_rule(const AttentionParams& p, bool deterministic, const DispatchFacts& f) {
  if (!(f.cuda && f.half && f.cc_major >= 8 && is_listed(kMmaBackwardHeadDims, p.head_dim))) {
    return BackwardVersion::kNaive;
  }
  if (f.hopper_built && f.cc_major == 9 && f.cc_minor == 0 && is_listed(kHopperBackwardHeadDims, p.head_dim) &&
      !deterministic) {
    return BackwardVersion::kWgmma;
  }
  return BackwardVersion::kMmaDqPass;
}

// The facts of q's device.
DispatchFacts facts_of([[maybe_unused]] const Tensor& q) {
  DispatchFacts f;
  f.half = half_dtype(q);
#ifdef WITH_CUDA
  if (q.is_cuda()) {
    f.cuda = true;
    f.cc_major = device_attribute(q, cudaDevAttrComputeCapabilityMajor);
    f.cc_minor = device_attribute(q, cudaDevAttrComputeCapabilityMinor);
    f.sms = device_attribute(q, cudaDevAttrMultiProcessorCount);
#ifdef COURSE_HOPPER
    f.hopper_built = true;
#endif
  }
#endif
  return f;
}

// p: the call's sizes, scale and mask (its pointers are not read here).
ForwardVersion default_forward(const Tensor& q, const AttentionParams& p) { return forward_rule(p, facts_of(q)); }
BackwardVersion default_backward(const Tensor& q, const AttentionParams& p) {
  return backward_rule(p, at::globalContext().deterministicAlgorithms(), facts_of(q));
}

// The accumulation type, which the log-sum-exp is kept in (attention.h).
at::ScalarType lse_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The CPU reference computes in the input's own type and exists in float32 and float64 only
// (16-bit attention on the CPU would be a different reference: rounding P to the dtype or not).
// The scalar CUDA rungs take all four floating types (16-bit computed in float32); float64 is
// there so that gradcheck runs on the GPU too (CONTRIBUTING.md, section 4). The tensor-core rungs
// (mma, pipelined, tuned, split_kv; mma and mma_dqpass backward) take the 16-bit types only, and
// version=None sends the others to the scalar rungs.
// meta tensors carry no device of their own: any of the four passes.
void check_dtype(const char* op, const char* name, const Tensor& t) {
  if (t.device().is_cpu()) {
    ::course::check_dtype_in(op, name, t, {at::kFloat, at::kDouble});
  } else {
    ::course::check_floating(op, name, t);
  }
}

// A (batch, heads, seqlen, head_dim) tensor of the kind every tensor argument is.
void check_bhsd(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_device_supported(op, name, t);
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " has shape ", shape_of(t), " (", std::to_string(t.dim()),
              " dims); it must have 4: (batch, heads, seqlen, head_dim)");
  check_dtype(op, name, t);
  // A size-1 dim's stride is never used to step, so any value is fine there.
  TORCH_CHECK(t.sym_stride(3) == 1 || t.sym_size(3) == 1, op, ": ", name,
              "'s last dim (head_dim) is not contiguous (stride ", std::to_string(t.stride(3)),
              "); other dims may be strided, the last must not: pass ", name, ".contiguous()");
}

// Another tensor that must sit where `ref` does, in its dtype.
void check_same(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  ::course::check_same_device(op, name, t, ref_name, ref);
  ::course::check_same_dtype(op, name, t, ref_name, ref);
}

// What a backward takes back from its forward: grad_out and out shaped, placed and typed as q,
// and lse the forward's statistics (float, double for double q) on q's device. The lse's shape is
// the caller's to check: (batch, heads, seqlen_q) for the padded layout, (heads, total_q) packed.
void check_backward_saved(const char* op, const char* forward, const Tensor& grad_out, const Tensor& out,
                          const Tensor& lse, const Tensor& q) {
  check_same(op, "grad_out", grad_out, "q", q);
  check_same(op, "out", out, "q", q);
  TORCH_CHECK(out.sym_sizes() == q.sym_sizes() && grad_out.sym_sizes() == q.sym_sizes(), op, ": out has shape ",
              shape_of(out), " and grad_out ", shape_of(grad_out), "; both must have q's shape ", shape_of(q));
  TORCH_CHECK(lse.defined(), op, ": lse is an undefined tensor");
  ::course::check_same_device(op, "lse", lse, "q", q);
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), op, ": lse has dtype ", lse.scalar_type(),
              " but must be ", lse_dtype(q.scalar_type()), " for q of dtype ", q.scalar_type(), " (what ", forward,
              " returns)");
}

void check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_bhsd(op, "q", q);
  check_bhsd(op, "k", k);
  check_bhsd(op, "v", v);
  check_same(op, "k", k, "q", q);
  check_same(op, "v", v, "q", q);
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), op, ": k has shape ", shape_of(k), " but v has shape ", shape_of(v),
              " (they must match: one value per key, in as many heads)");
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0), op, ": q has batch ", std::to_string(q.size(0)), " but k has batch ",
              std::to_string(k.size(0)));
  TORCH_CHECK(k.sym_size(3) == q.sym_size(3), op, ": q has head_dim ", std::to_string(q.size(3)),
              " but k and v have head_dim ", std::to_string(k.size(3)), " (they must be equal)");
  TORCH_CHECK(q.sym_size(3) >= 1, op, ": head_dim is 0; attention needs at least one feature per head");
  const int64_t heads = q.size(1);
  const int64_t heads_kv = k.size(1);
  TORCH_CHECK(heads_kv >= 1 && heads % heads_kv == 0, op, ": q has ", std::to_string(heads), " heads and k and v ",
              "have ", std::to_string(heads_kv), "; the query heads must be a whole multiple of the kv heads ",
              "(grouped-query attention: each kv head serves heads / heads_kv query heads)");
  if (q.is_cuda()) {
    TORCH_CHECK(is_listed(kCudaHeadDims, q.size(3)), op, ": head_dim ", std::to_string(q.size(3)),
                " is not supported on CUDA (supported: ", list_text(kCudaHeadDims), ")");
  }
}

// window = (left, right), each a bound >= 0 or -1 (none), and softcap >= 0 (0: none), finite: a
// NaN or infinite cap would silently give NaN or no cap at all.
void check_window_softcap(const char* op, at::IntArrayRef window, double softcap) {
  std::string got;
  for (const int64_t w : window) got += (got.empty() ? "" : ", ") + std::to_string(w);
  TORCH_CHECK(window.size() == 2 && window[0] >= -1 && window[1] >= -1, op,
              ": window must be (left, right) with each >= 0 or -1, got (", got, ")");
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap must be >= 0 and finite (0: no cap), got ",
              std::to_string(softcap));
}

// The rungs that compute a window and a softcap: the forward's "tuned" and "split_kv" (one kernel)
// and "persistent" (its kWindowSoftcap instantiation, at kHopperWindowHeadDims and in the padded
// layout: check_hopper_window says so by name), the backward's "mma" and "mma_dqpass" (one kernel
// for dK and dV; dQ from it or from its second pass) and "wgmma" (its kWindowSoftcap
// instantiation, at kHopperBackwardHeadDims, padded layout only). Every other rung refuses them
// with the way out; the CPU reference computes them all.
bool takes_window_or_softcap(ForwardVersion v) {
  return v == ForwardVersion::kTuned || v == ForwardVersion::kSplitKv || v == ForwardVersion::kPersistent;
}
// "persistent" with a window or a softcap: the head dims it was built for, with the way out.
void check_hopper_window(const char* op, const AttentionParams& p) {
  TORCH_CHECK(is_listed(kHopperWindowHeadDims, p.head_dim), op, ": version 'persistent' takes a window or ",
              "softcap at head_dim ", list_text(kHopperWindowHeadDims), "; head_dim is ", std::to_string(p.head_dim),
              ": use version='split_kv' (version=None picks it there)");
}
bool takes_window_or_softcap(BackwardVersion v) {
  return v == BackwardVersion::kMma || v == BackwardVersion::kMmaDqPass || v == BackwardVersion::kWgmma;
}

#define FLASH_ATTENTION_ON_CUDA(op, t, ...) COURSE_ON_CUDA(op, "flash_attention", t, __VA_ARGS__)

#ifdef WITH_CUDA
// The launches, on `stream` (the current stream of q's device, under its device guard: see
// COURSE_ON_CUDA). Workspaces come from torch's caching allocator here, never from the
// launchers: stream-ordered, freed with the tensor at the end of the scope (the allocator
// keeps the block from reuse until the stream has passed this point), and inside a CUDA graph
// capture taken from the graph's pool.
Tensor workspace(int64_t bytes, const Tensor& like) { return at::empty({bytes}, like.options().dtype(at::kByte)); }

void forward_cuda(ForwardVersion v, const AttentionParams& p, const Tensor& q, cudaStream_t stream) {
  switch (v) {
    case ForwardVersion::kNaive: {
      const Tensor scratch = workspace(attention_forward_naive_workspace(p), q);
      C10_CUDA_CHECK(launch_attention_forward_naive(p, scratch.mutable_data_ptr(), stream));
      return;
    }
    case ForwardVersion::kTiled:
      C10_CUDA_CHECK(launch_attention_forward_tiled(p, stream));
      return;
    case ForwardVersion::kMma:
      C10_CUDA_CHECK(launch_attention_forward_mma(p, MmaForward::kMma, stream));
      return;
    case ForwardVersion::kPipelined:
      C10_CUDA_CHECK(launch_attention_forward_mma(p, MmaForward::kPipelined, stream));
      return;
    case ForwardVersion::kTuned:
      C10_CUDA_CHECK(launch_attention_forward_mma(p, MmaForward::kTuned, stream));
      return;
    case ForwardVersion::kSplitKv: {
      const int64_t splits = attention_forward_splits(p, device_attribute(q, cudaDevAttrMultiProcessorCount));
      const Tensor partials = workspace(attention_forward_split_workspace(p, splits), q);
      C10_CUDA_CHECK(launch_attention_forward_mma(p, MmaForward::kSplitKv, stream, splits, partials.mutable_data_ptr()));
      return;
    }
    case ForwardVersion::kWgmma:
    case ForwardVersion::kWarpSpecialized:
    case ForwardVersion::kPingpong:
    case ForwardVersion::kPersistent: {
#ifdef COURSE_HOPPER
      // The persistent rung's tile counter (4 bytes from the caching allocator; the launcher clears it).
      // Packed, also the schedule it orders the sequences' tiles by (sized from the host ints).
      const int64_t bytes = attention_forward_hopper_workspace(p, hopper_kind(v));
      const Tensor scratch = bytes > 0 ? workspace(bytes, q) : Tensor();
      C10_CUDA_CHECK(launch_attention_forward_hopper(p, hopper_kind(v), stream,
                                                     bytes > 0 ? scratch.mutable_data_ptr() : nullptr));
#endif
      return;  // without the sm_90a kernels check_hopper_rung has refused the call already
    }
  }
}

// What the tensor-core rungs need beyond the other checks, each refused with the way out.
// q: padded (batch, heads, seqlen, head_dim) or packed (total, heads, head_dim), head_dim last either way.
void check_tensor_core_rung(const char* op, const std::string& name, const Tensor& q, bool backward = false) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op, ": version '", name,
              "' runs on tensor cores and takes float16 and bfloat16; q is ", q.scalar_type(),
              " (float32 and float64 run on ", backward ? "version 'naive'" : "versions 'naive' and 'tiled'", ")");
  const int major = device_attribute(q, cudaDevAttrComputeCapabilityMajor);
  const int minor = device_attribute(q, cudaDevAttrComputeCapabilityMinor);
  TORCH_CHECK(major >= 8, op, ": version '", name, "' needs compute capability 8.0 or newer ",
              "(mma.sync m16n8k16 in 16-bit types and cp.async); this GPU is ", std::to_string(major), ".",
              std::to_string(minor), ": use version='tiled'");
  if (backward) {
    TORCH_CHECK(is_listed(kMmaBackwardHeadDims, q.size(-1)), op, ": version '", name, "' takes head_dim ",
                list_text(kMmaBackwardHeadDims), " (its dK and dV rows live in registers); head_dim is ",
                std::to_string(q.size(-1)), ": use version='naive'");
  }
  const int64_t smem = backward ? attention_backward_mma_smem_bytes(q.size(-1))
                                : attention_forward_mma_smem_bytes(q.size(-1), mma_rung(name));
  const int64_t allowed = device_attribute(q, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(smem <= allowed, op, ": version '", name, "' at head_dim ", std::to_string(q.size(-1)), " takes ",
              std::to_string(smem / 1024), " KiB of shared memory per block; this GPU (", std::to_string(major),
              ".", std::to_string(minor), ") allows ", std::to_string(allowed / 1024),
              " KiB: use version='mma' or 'tiled'");
}

// What every part 3 rung needs first, forward or backward, each refused with the way out: 16-bit
// inputs, a build that has the sm_90a kernels, a Hopper GPU. `scalar` names the rungs that take
// float32 and float64, `instead` the rung to use where part 3's cannot run.
void check_hopper_build_and_gpu(const char* op, const std::string& name, const Tensor& q, const char* scalar,
                                const char* instead) {
  TORCH_CHECK(half_dtype(q), op, ": version '", name, "' runs on tensor cores and takes float16 and bfloat16; q is ",
              q.scalar_type(), " (float32 and float64 run on ", scalar, ")");
#ifndef COURSE_HOPPER
  TORCH_CHECK(false, op, ": version '", name, "' is a Hopper kernel (sm_90a), and this build of flash_attention ",
              "has none: it was compiled for a TORCH_CUDA_ARCH_LIST without 9.0. Rebuild with 9.0 in the list ",
              "(the default on a Hopper GPU), or use version='", instead, "'");
#endif
  const int major = device_attribute(q, cudaDevAttrComputeCapabilityMajor);
  const int minor = device_attribute(q, cudaDevAttrComputeCapabilityMinor);
  TORCH_CHECK(major == 9 && minor == 0, op, ": version '", name, "' needs a Hopper GPU, compute capability 9.0 ",
              "(wgmma, TMA and setmaxnreg; sm_90a code runs on no other); this GPU is ", std::to_string(major), ".",
              std::to_string(minor), ": use version='", instead, "'");
}

// What part 3's rungs need, each refused with the way out: a build that has them, a Hopper GPU,
// a head dim of whole 64-column chunks, a positive scale. q: padded or packed, head_dim last.
void check_hopper_rung(const char* op, ForwardVersion v, const Tensor& q, double scale) {
  const std::string name = ::course::version_name(kForwardVersions, v);
  check_hopper_build_and_gpu(op, name, q, "versions 'naive' and 'tiled'", "tuned");
  TORCH_CHECK(attention_forward_hopper_head_dim(q.size(-1)), op, ": version '", name,
              "' takes head_dim 64, 128 or 256 (whole 64-column chunks, the width of its 128-byte swizzle); ",
              "head_dim is ", std::to_string(q.size(-1)), ": use version='tuned'");
  TORCH_CHECK(scale > 0.0, op, ": version '", name, "' takes scale > 0 (its softmax keeps each row's maximum ",
              "of the unscaled scores, which is the maximum of the scaled ones only for a positive scale); scale ",
              "is ", std::to_string(scale), ": use version='tuned'");
#ifdef COURSE_HOPPER
  const int64_t smem = attention_forward_hopper_smem_bytes(q.size(-1), hopper_kind(v));
  const int64_t allowed = device_attribute(q, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(smem <= allowed, op, ": version '", name, "' at head_dim ", std::to_string(q.size(-1)), " takes ",
              std::to_string(smem / 1024), " KiB of shared memory per block; this GPU allows ",
              std::to_string(allowed / 1024), " KiB: use version='tuned'");
#endif
}

// What part 3's backward rung needs, each refused with the way out: the forward's Hopper checks
// (a build that has it, a Hopper GPU), the head dims whose dK and dV fit its registers, and the
// shared memory. Any scale: the backward keeps no running maximum.
// q: (batch, heads, seqlen, head_dim), or packed (total, heads, head_dim).
void check_hopper_backward(const char* op, const Tensor& q) {
  const std::string name = ::course::version_name(kBackwardVersions, BackwardVersion::kWgmma);
  check_hopper_build_and_gpu(op, name, q, "version 'naive'", "mma_dqpass");
  const int64_t d = q.size(-1);
  TORCH_CHECK(attention_backward_hopper_head_dim(d), op, ": version '", name, "' takes head_dim ",
              list_text(kHopperBackwardHeadDims), " (whole 64-column chunks, with dK and dV of 64 keys in ",
              "registers); head_dim is ", std::to_string(d), ": use version='mma_dqpass' or 'naive'");
#ifdef COURSE_HOPPER
  const int64_t smem = attention_backward_hopper_smem_bytes(d);
  const int64_t allowed = device_attribute(q, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(smem <= allowed, op, ": version '", name, "' at head_dim ", std::to_string(d), " takes ",
              std::to_string(smem / 1024), " KiB of shared memory per block; this GPU allows ",
              std::to_string(allowed / 1024), " KiB: use version='mma_dqpass'");
#endif
}

// The tensor-core rungs copy 16 bytes at a time: every stride that is stepped (dims of size > 1)
// a multiple of 8 elements and the data 16-byte aligned. A view that is not (an odd slice of a
// sequence, a storage offset) is copied once, contiguous; views of (batch, seqlen, heads, d)
// projections, the common case, pass as they are.
// Part 3's TMA copies also need every stepped stride non-zero (a tensor map describes memory,
// not a broadcast): an expanded view (k.expand for grouped heads) is copied there too.
Tensor aligned_for_copies(const Tensor& t, bool tma = false) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) {  // every dim but head_dim: 4 padded, 3 packed
    ok = ok && (t.size(dim) == 1 || (t.stride(dim) % 8 == 0 && (!tma || t.stride(dim) != 0)));
  }
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void backward_cuda(BackwardVersion v, const AttentionBackwardParams& g, const Tensor& q, cudaStream_t stream) {
  switch (v) {
    case BackwardVersion::kNaive: {
      const Tensor scratch = workspace(attention_backward_naive_workspace(g), q);
      C10_CUDA_CHECK(launch_attention_backward_naive(g, scratch.mutable_data_ptr(), stream));
      return;
    }
    case BackwardVersion::kMma:
    case BackwardVersion::kMmaDqPass: {
      // dQ's float32 sums start at 0: every key tile adds into them.
      const bool atomic = v == BackwardVersion::kMma;
      const Tensor scratch = at::zeros({attention_backward_mma_workspace(g, atomic)}, q.options().dtype(at::kByte));
      C10_CUDA_CHECK(launch_attention_backward_mma(g, atomic, scratch.mutable_data_ptr(), stream));
      return;
    }
    case BackwardVersion::kWgmma: {
#ifdef COURSE_HOPPER
      // dQ's float32 sums start at 0: the statistics kernel writes the zeros in its own pass (and
      // every statistics row), so the workspace comes uninitialized, but for the old side kernels
      // (FLASH_ATTENTION_BWD_SIDE=old, a bench-only knob: flash_bwd_hopper.h), which need a memset.
      const HopperBwdSide side = attention_backward_hopper_side();
      TORCH_CHECK(side != HopperBwdSide::kUnknown, "FLASH_ATTENTION_BWD_SIDE is '",
                  std::getenv("FLASH_ATTENTION_BWD_SIDE"), "'; expected new, elementwise or old (or unset: new)");
      const int64_t bytes = attention_backward_hopper_workspace(g);
      const Tensor scratch = side == HopperBwdSide::kOld ? at::zeros({bytes}, q.options().dtype(at::kByte))
                                                         : at::empty({bytes}, q.options().dtype(at::kByte));
      C10_CUDA_CHECK(launch_attention_backward_hopper(g, side, scratch.mutable_data_ptr(), stream));
#endif
      return;  // without the sm_90a kernels check_hopper_backward has refused the call already
    }
  }
}
#endif

// The backward's params: the forward's, and where dO is read and dq, dk, dv are written (all
// (batch, heads, seq, head_dim) views with a unit last stride).
AttentionBackwardParams make_backward_params(const AttentionParams& fwd, const Tensor& grad_out, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv) {
  AttentionBackwardParams g{};
  g.fwd = fwd;
  g.dout = grad_out.const_data_ptr();
  g.dq = dq.mutable_data_ptr();
  g.dk = dk.mutable_data_ptr();
  g.dv = dv.mutable_data_ptr();
  g.do_batch_stride = grad_out.stride(0), g.do_head_stride = grad_out.stride(1), g.do_seq_stride = grad_out.stride(2);
  g.dq_batch_stride = dq.stride(0), g.dq_head_stride = dq.stride(1), g.dq_seq_stride = dq.stride(2);
  g.dk_batch_stride = dk.stride(0), g.dk_head_stride = dk.stride(1), g.dk_seq_stride = dk.stride(2);
  g.dv_batch_stride = dv.stride(0), g.dv_head_stride = dv.stride(1), g.dv_seq_stride = dv.stride(2);
  return g;
}

// ---------------------------------------------------------------------------------------
// attention_forward: (out, lse). out is (batch, heads, seqlen_q, head_dim), contiguous, q's
// dtype; lse is (batch, heads, seqlen_q), contiguous, in the accumulation type.
// ---------------------------------------------------------------------------------------
std::tuple<Tensor, Tensor> attention_forward_impl(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                                  bool causal, OptVersion version, at::IntArrayRef window,
                                                  double softcap) {
  const char* op = kForward;
  check_qkv(op, q, k, v);
  check_window_softcap(op, window, softcap);
  Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  Tensor lse = at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2)},
                                q.options().dtype(lse_dtype(q.scalar_type())));
  const auto named = ::course::parse_version(op, version, kForwardVersions);  // a typo fails on Meta too
  if (q.is_meta()) return {out, lse};
  const AttentionParams sizes = make_params(q, k, v, out, lse, scale, causal, window, softcap);
  [[maybe_unused]] const ForwardVersion v_ = named.value_or(default_forward(q, sizes));
  if (q.is_cuda() && uses_window_or_softcap(sizes)) {
    TORCH_CHECK(takes_window_or_softcap(v_), op, ": version '", ::course::version_name(kForwardVersions, v_),
                "' takes no window or softcap; versions 'tuned', 'split_kv' and 'persistent' compute them (float16 ",
                "and bfloat16, compute capability 8.0 or newer; 'persistent' on 9.0 at head_dim ",
                list_text(kHopperWindowHeadDims), "; version=None picks them there)");
    if (v_ == ForwardVersion::kPersistent) check_hopper_window(op, sizes);
  }
  if (out.numel() == 0) return {out, lse};
  if (q.is_cuda()) {
#ifdef WITH_CUDA
    if (tensor_core_rung(v_) || hopper_rung(v_)) {
      if (hopper_rung(v_)) {
        check_hopper_rung(op, v_, q, scale);
      } else {
        check_tensor_core_rung(op, ::course::version_name(kForwardVersions, v_), q);
      }
      const bool tma = hopper_rung(v_);
      const Tensor qa = aligned_for_copies(q, tma), ka = aligned_for_copies(k, tma), va = aligned_for_copies(v, tma);
      const AttentionParams p = make_params(qa, ka, va, out, lse, scale, causal, window, softcap);
      FLASH_ATTENTION_ON_CUDA(op, q, forward_cuda(v_, p, q, stream));
      return {out, lse};
    }
#endif
    FLASH_ATTENTION_ON_CUDA(op, q, forward_cuda(v_, sizes, q, stream));
  } else {
    attention_forward_cpu(sizes);
  }
  return {out, lse};
}

// ---------------------------------------------------------------------------------------
// attention_backward: (dq, dk, dv), each contiguous in the shape of q, k, v, from the
// forward's out and lse.
// ---------------------------------------------------------------------------------------
std::tuple<Tensor, Tensor, Tensor> attention_backward_impl(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                                           const Tensor& v, const Tensor& out, const Tensor& lse,
                                                           double scale, bool causal, OptVersion version,
                                                           at::IntArrayRef window, double softcap) {
  const char* op = kBackward;
  check_qkv(op, q, k, v);
  check_window_softcap(op, window, softcap);
  check_bhsd(op, "grad_out", grad_out);
  check_bhsd(op, "out", out);
  check_backward_saved(op, "attention_forward", grad_out, out, lse, q);
  TORCH_CHECK(lse.dim() == 3 && lse.sym_size(0) == q.sym_size(0) && lse.sym_size(1) == q.sym_size(1) &&
                  lse.sym_size(2) == q.sym_size(2),
              op, ": lse has shape ", shape_of(lse), " but must be (batch, heads, seqlen_q) of q ", shape_of(q));
  const auto named = ::course::parse_version(op, version, kBackwardVersions);  // a typo fails on Meta too
  Tensor dq = at::empty_symint(q.sym_sizes(), q.options());
  Tensor dk = at::empty_symint(k.sym_sizes(), k.options());
  Tensor dv = at::empty_symint(v.sym_sizes(), v.options());
  if (q.is_meta()) return {dq, dk, dv};
  const AttentionParams sizes = make_params(q, k, v, out, lse, scale, causal, window, softcap);
  [[maybe_unused]] const BackwardVersion v_ = named.value_or(default_backward(q, sizes));
  if (q.is_cuda() && uses_window_or_softcap(sizes)) {
    TORCH_CHECK(takes_window_or_softcap(v_), op, ": version '", ::course::version_name(kBackwardVersions, v_),
                "' takes no window or softcap; versions 'mma' and 'mma_dqpass' compute them (float16 and bfloat16, ",
                "compute capability 8.0 or newer, head_dim ", list_text(kMmaBackwardHeadDims),
                "), and 'wgmma' on 9.0 at head_dim ", list_text(kHopperBackwardHeadDims),
                " (version=None picks 'wgmma' there, else 'mma_dqpass')");
  }
  // The reference and the kernels index lse as a contiguous (batch, heads, seqlen_q) block.
  const Tensor lse_c = lse.contiguous();
  // The tensor-core rung copies Q, dO, K and V 16 bytes at a time (aligned_for_copies); the
  // others read any strides. The copies, where made, live until the launch is queued.
  Tensor qa = q, ka = k, va = v, goa = grad_out;
#ifdef WITH_CUDA
  if (q.is_cuda() && (v_ == BackwardVersion::kMma || v_ == BackwardVersion::kMmaDqPass)) {
    check_tensor_core_rung(op, ::course::version_name(kBackwardVersions, v_), q, /*backward=*/true);
    qa = aligned_for_copies(q), ka = aligned_for_copies(k), va = aligned_for_copies(v);
    goa = aligned_for_copies(grad_out);
  }
  if (q.is_cuda() && v_ == BackwardVersion::kWgmma) {
    check_hopper_backward(op, q);
    // TMA's rules as the Hopper forward's: no stride 0 either (an expanded k is copied).
    qa = aligned_for_copies(q, true), ka = aligned_for_copies(k, true), va = aligned_for_copies(v, true);
    goa = aligned_for_copies(grad_out, true);
  }
#endif
  const AttentionBackwardParams g =
      make_backward_params(make_params(qa, ka, va, out, lse_c, scale, causal, window, softcap), goa, dq, dk, dv);
  if (q.is_cuda()) {
    FLASH_ATTENTION_ON_CUDA(op, q, backward_cuda(v_, g, q, stream));
  } else {
    attention_backward_cpu(g);
  }
  return {dq, dk, dv};
}

// ---------------------------------------------------------------------------------------
// Autograd. The forward re-enters the dispatcher below the Autograd key (the CPU or CUDA kernel,
// or the Meta one under torch.compile) and saves q, k, v, out and lse; the backward is this chapter's
// own op, reached through the dispatcher so that tracing sees it. lse is an output for the
// learner and the backward, not a differentiable one. First derivatives only.
// ---------------------------------------------------------------------------------------
using ::course::find_op;

// The scores' scale and mask, which both attention Functions keep for their backward beside the
// tensors: saved by the forward, read back by the backward.
struct SavedScores {
  double scale;
  bool causal;
  std::vector<int64_t> window;
  double softcap;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    ctx->saved_data["softcap"] = softcap;
  }
  static SavedScores load(AutogradContext* ctx) {
    return {ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
            ctx->saved_data["window"].toIntVector(), ctx->saved_data["softcap"].toDouble()};
  }
};

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                               bool causal, OptVersion version, at::IntArrayRef window, double softcap) {
    static auto op = find_op<decltype(attention_forward_impl)>("flash_attention::attention_forward");
    Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, lse) = op.call(q, k, v, scale, causal, version, window, softcap);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    SavedScores{scale, causal, window.vec(), softcap}.save(ctx);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(attention_backward_impl)>("flash_attention::attention_backward");
    const auto s = ctx->get_saved_variables();
    Tensor grad_out = grads[0];
    // out.sum() hands back an expanded scalar (every stride 0): the one input whose last dim is
    // not ours to choose, so it alone may be copied.
    if (grad_out.sym_stride(3) != 1 && grad_out.sym_size(3) != 1) grad_out = grad_out.contiguous();
    const SavedScores m = SavedScores::load(ctx);
    auto [dq, dk, dv] =
        op.call(grad_out, s[0], s[1], s[2], s[3], s[4], m.scale, m.causal, std::nullopt, m.window, m.softcap);
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                                      bool causal, OptVersion version, at::IntArrayRef window,
                                                      double softcap) {
  auto out = AttentionFunction::apply(q, k, v, scale, causal, version, window, softcap);
  return {out[0], out[1]};
}

// ---------------------------------------------------------------------------------------
// attention_varlen_forward and attention_varlen_backward: sequences of different lengths packed
// along one token dim, FlashAttention 2's varlen API. q is (total_q, heads, head_dim), k and v
// (total_k, heads_kv, head_dim); sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q
// and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v, attended to as one attention_forward of
// batch 1 (its own bottom-right causal mask and window). lse is (heads, total_q), FlashAttention 2's
// varlen softmax_lse. No token of one sequence sees another's, and no padding is computed: the
// point of the layout. On the CPU each sequence is the reference's AttentionParams over slices of
// the packed tensors (their strides, no copy). On CUDA one launch does every sequence
// (attention.h's cu_seqlens: the kernels read the lengths on the device), on the rungs that take
// the packed layout: the forward's "tuned" and "split_kv", the backward's "mma" and "mma_dqpass";
// version=None picks "split_kv" and "mma_dqpass", and every other rung refuses it with the way
// out. max_seqlen_q and max_seqlen_k are host ints, as in FlashAttention 2: they size the grid, so
// the op never reads cu_seqlens on the host, a device-to-host sync that would stall the stream and
// break CUDA-graph capture. So on CUDA the lengths are trusted (as FlashAttention 2 trusts them):
// the CPU checks every value, CUDA only what the shapes tell (a total longer than batch x
// max_seqlen).
// ---------------------------------------------------------------------------------------
constexpr const char* kVarlenForward = "attention_varlen_forward";
constexpr const char* kVarlenBackward = "attention_varlen_backward";

// Sequence [start, start + len) of a packed (total, heads, d) tensor as a (1, heads, len, d) view:
// the shape every AttentionParams describes.
Tensor as_batch_of_one(const Tensor& t, int64_t start, int64_t len) {
  return t.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
}

// A packed (total_tokens, heads, head_dim) tensor.
void check_packed(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_device_supported(op, name, t);
  TORCH_CHECK(t.dim() == 3, op, ": ", name, " has shape ", shape_of(t), " (", std::to_string(t.dim()),
              " dims); it must have 3: (total_tokens, heads, head_dim)");
  check_dtype(op, name, t);
  TORCH_CHECK(t.sym_stride(2) == 1 || t.sym_size(2) == 1, op, ": ", name,
              "'s last dim (head_dim) is not contiguous (stride ", std::to_string(t.stride(2)), "); pass ", name,
              ".contiguous()");
}

// cu_seqlens: int32, (batch + 1,), on q's device. Its values are checked where they are read (the
// CPU): from 0, never decreasing, to the packed tensor's total, no sequence longer than max_seqlen.
void check_cu_seqlens(const char* op, const char* name, const Tensor& cu, const Tensor& q) {
  TORCH_CHECK(cu.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_same_device(op, name, cu, "q", q);
  TORCH_CHECK(cu.scalar_type() == at::kInt, op, ": ", name, " has dtype ", cu.scalar_type(),
              " but must be Int (int32: the cumulative sequence lengths, FlashAttention 2's layout)");
  TORCH_CHECK(cu.dim() == 1 && cu.sym_size(0) >= 1, op, ": ", name, " has shape ", shape_of(cu),
              "; it must be (batch + 1,): 0, then each sequence's end");
}
std::vector<int64_t> seqlen_offsets(const char* op, const char* name, const Tensor& cu, int64_t total,
                                    int64_t max_seqlen, const char* max_name) {
  const Tensor c = cu.contiguous();
  const int32_t* data = c.const_data_ptr<int32_t>();
  std::vector<int64_t> offsets(data, data + c.numel());
  TORCH_CHECK(offsets[0] == 0, op, ": ", name, "[0] is ", std::to_string(offsets[0]), "; it must be 0");
  for (size_t b = 0; b + 1 < offsets.size(); ++b) {
    const int64_t len = offsets[b + 1] - offsets[b];
    TORCH_CHECK(len >= 0, op, ": ", name, " decreases at ", std::to_string(b + 1), " (", std::to_string(offsets[b]),
                " then ", std::to_string(offsets[b + 1]), "); sequence lengths cannot be negative");
    TORCH_CHECK(len <= max_seqlen, op, ": sequence ", std::to_string(b), " has ", std::to_string(len), " tokens (",
                name, ") but ", max_name, " is ", std::to_string(max_seqlen));
  }
  TORCH_CHECK(offsets.back() == total, op, ": ", name, " ends at ", std::to_string(offsets.back()),
              " but the packed tensor has ", std::to_string(total), " tokens");
  return offsets;
}

void check_varlen(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                  const Tensor& cu_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_packed(op, "q", q);
  check_packed(op, "k", k);
  check_packed(op, "v", v);
  check_same(op, "k", k, "q", q);
  check_same(op, "v", v, "q", q);
  TORCH_CHECK(k.sym_sizes() == v.sym_sizes(), op, ": k has shape ", shape_of(k), " but v has shape ", shape_of(v),
              " (they must match: one value per key, in as many heads)");
  TORCH_CHECK(k.sym_size(2) == q.sym_size(2), op, ": q has head_dim ", std::to_string(q.size(2)),
              " but k and v have head_dim ", std::to_string(k.size(2)), " (they must be equal)");
  TORCH_CHECK(q.sym_size(2) >= 1, op, ": head_dim is 0; attention needs at least one feature per head");
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, op, ": q has ", std::to_string(q.size(1)),
              " heads and k and v have ", std::to_string(k.size(1)), "; the query heads must be a whole multiple of ",
              "the kv heads");
  check_cu_seqlens(op, "cu_seqlens_q", cu_q, q);
  check_cu_seqlens(op, "cu_seqlens_k", cu_k, q);
  TORCH_CHECK(cu_q.sym_size(0) == cu_k.sym_size(0), op, ": cu_seqlens_q has ", std::to_string(cu_q.size(0)),
              " entries but cu_seqlens_k has ", std::to_string(cu_k.size(0)), " (one more than the batch, both)");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, op, ": max_seqlen_q and max_seqlen_k must be >= 0, got ",
              std::to_string(max_seqlen_q), " and ", std::to_string(max_seqlen_k));
}

// The rungs that take the packed layout on CUDA (the kernels with a kVarlen instantiation), and
// version=None's choice among them. Forward: on a Hopper GPU "persistent" (its tensor maps describe
// the packed tensors, and its schedule orders the sequences' own tiles longest first:
// csrc/hopper/tile_schedule.h) where it applies, at kHopperVarlenHeadDims without a window or a
// softcap, and where the grid over the max lengths fills the GPU unsplit (as the padded rule,
// read over max_seqlen_q and max_seqlen_k: where it would split, a few query rows against long
// keys, "split_kv" wins as in the padded layout); elsewhere "split_kv" (which is "tuned" wherever the
// grid fills the GPU, and splits the keys where it does not). The other Hopper rungs take the
// padded layout only (their tensor maps describe whole (batch, head) slices). Backward: on a Hopper
// GPU "wgmma" (its kVarlen instantiation: maps over the packed tensors, a block per sequence's key
// tile) at kHopperBackwardHeadDims without a window or a softcap, and not under deterministic
// algorithms; elsewhere "mma_dqpass", for the reasons the padded rule gives (the version=None
// section above). No rung where the tensor-core rungs do not run: the scalar rungs have no packed
// kernels.
bool takes_varlen(ForwardVersion v) {
  return v == ForwardVersion::kTuned || v == ForwardVersion::kSplitKv || v == ForwardVersion::kPersistent;
}
bool takes_varlen(BackwardVersion v) {
  return v == BackwardVersion::kMma || v == BackwardVersion::kMmaDqPass || v == BackwardVersion::kWgmma;
}
// p: the packed call's sizes (attention.h: batch the sequence count, seqlen_q and seqlen_k the max
// lengths), scale and mask.
std::optional<ForwardVersion> varlen_forward_rule(const AttentionParams& p, const DispatchFacts& f) {
  if (!(f.cuda && f.half && f.cc_major >= 8)) return std::nullopt;
  if (f.hopper_built && f.cc_major == 9 && f.cc_minor == 0 && is_listed(kHopperVarlenHeadDims, p.head_dim) &&
      p.scale > 0.0 && !uses_window_or_softcap(p) && attention_forward_splits(p, f.sms) == 1) {
    return ForwardVersion::kPersistent;
  }
  return ForwardVersion::kSplitKv;
}
std::optional<BackwardVersion> varlen_backward_rule(const AttentionParams& p, bool deterministic,
                                                    const DispatchFacts& f) {
  if (!(f.cuda && f.half && f.cc_major >= 8 && is_listed(kMmaBackwardHeadDims, p.head_dim))) return std::nullopt;
  // The padded rule's, less the window and the softcap (the kVarlen instantiation has neither).
  if (f.hopper_built && f.cc_major == 9 && f.cc_minor == 0 && is_listed(kHopperBackwardHeadDims, p.head_dim) &&
      !uses_window_or_softcap(p) && !deterministic) {
    return BackwardVersion::kWgmma;
  }
  return BackwardVersion::kMmaDqPass;
}

#ifdef WITH_CUDA
// What a CUDA call in the packed layout needs beyond check_varlen, each refused with the way out:
// a rung that takes the layout (the one named, else version=None's), inputs it runs (`chosen`, the
// rule's answer for these facts: none where the tensor-core rungs do not run), a head dim the
// kernels were built for, and the lengths' totals within batch x max_seqlen (what the host can
// check without reading cu_seqlens). Returns the rung's name.
template <typename V, size_t N>
std::string varlen_cuda_rung(const char* op, const ::course::NamedVersion<V> (&versions)[N], std::optional<V> named,
                             std::optional<V> chosen, const Tensor& q, const Tensor& k, const Tensor& cu_q,
                             int64_t max_seqlen_q, int64_t max_seqlen_k, bool backward) {
  const char* rungs =
      backward ? "versions 'mma', 'mma_dqpass' and 'wgmma'" : "versions 'tuned', 'split_kv' and 'persistent'";
  const std::string takes = backward ? std::string("float16 and bfloat16, compute capability 8.0 or newer, head_dim ") +
                                           list_text(kMmaBackwardHeadDims) + "; 'wgmma' on 9.0 at head_dim " +
                                           list_text(kHopperBackwardHeadDims)
                                     : std::string("float16 and bfloat16, compute capability 8.0 or newer; "
                                                   "'persistent' on 9.0 at head_dim ") +
                                           list_text(kHopperVarlenHeadDims);
  const char* what = backward ? "the packed (varlen) layout's backward" : "the packed (varlen) layout";
  if (named) {
    TORCH_CHECK(takes_varlen(*named), op, ": version '", ::course::version_name(versions, *named),
                "' does not take the packed (varlen) layout; ", rungs, " take it (", takes, "; version=None picks ",
                backward ? "'wgmma' on a Hopper GPU where it applies, else 'mma_dqpass'"
                         : "'persistent' on a Hopper GPU where it applies, else 'split_kv'",
                " there)");
  }
  // version=None has no rung here, and then neither can the rung named run these inputs on this GPU
  // (the same facts decide both): one message, with the way out.
  TORCH_CHECK(chosen.has_value(), op,
              ": on CUDA ", what, " runs on ", rungs, " alone (", takes, "); q is ", q.scalar_type(), " at head_dim ",
              std::to_string(q.size(2)), " on a GPU of compute capability ",
              std::to_string(device_attribute(q, cudaDevAttrComputeCapabilityMajor)), ".",
              std::to_string(device_attribute(q, cudaDevAttrComputeCapabilityMinor)),
              ": convert q, k and v to bfloat16 or float16, or pass CPU tensors (the reference)");
  const V v = named ? *named : *chosen;
  TORCH_CHECK(is_listed(kCudaHeadDims, q.size(2)), op, ": head_dim ", std::to_string(q.size(2)),
              " is not supported on CUDA (supported: ", list_text(kCudaHeadDims), ")");
  const int64_t batch = cu_q.size(0) - 1;
  TORCH_CHECK(q.size(0) <= batch * max_seqlen_q && k.size(0) <= batch * max_seqlen_k, op, ": ",
              std::to_string(batch), " sequences of at most max_seqlen_q = ", std::to_string(max_seqlen_q),
              " and max_seqlen_k = ", std::to_string(max_seqlen_k), " tokens cannot hold ", std::to_string(q.size(0)),
              " query and ", std::to_string(k.size(0)), " key tokens: max_seqlen_q and max_seqlen_k must be at least ",
              "the longest sequence's lengths");
  return ::course::version_name(versions, v);
}

// The packed tensors as a padded batch (attention.h's packed layout): the reference's view of all
// the tokens as one sequence gives the head and token strides, then batch is the sequence count,
// seqlen_q and seqlen_k the max lengths, and the kernels find each sequence through cu_seqlens.
AttentionParams make_varlen_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, const Tensor& cu_q, const Tensor& cu_k, int64_t max_seqlen_q,
                                   int64_t max_seqlen_k, double scale, bool causal, at::IntArrayRef window,
                                   double softcap) {
  AttentionParams p = make_params(as_batch_of_one(q, 0, q.size(0)), as_batch_of_one(k, 0, k.size(0)),
                                  as_batch_of_one(v, 0, v.size(0)), as_batch_of_one(out, 0, out.size(0)), lse, scale,
                                  causal, window, softcap);
  p.batch = cu_q.size(0) - 1;
  p.seqlen_q = max_seqlen_q;
  p.seqlen_k = max_seqlen_k;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;
  p.cu_seqlens_q = cu_q.const_data_ptr<int32_t>();
  p.cu_seqlens_k = cu_k.const_data_ptr<int32_t>();
  p.total_q = q.size(0);
  p.total_k = k.size(0);
  return p;
}
#endif

std::tuple<Tensor, Tensor> attention_varlen_forward_impl(const Tensor& q, const Tensor& k, const Tensor& v,
                                                         const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                         int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                         bool causal, at::IntArrayRef window, double softcap,
                                                         OptVersion version) {
  const char* op = kVarlenForward;
  check_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_window_softcap(op, window, softcap);
  Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  Tensor lse = at::empty_symint({q.sym_size(1), q.sym_size(0)}, q.options().dtype(lse_dtype(q.scalar_type())));
  [[maybe_unused]] const auto named = ::course::parse_version(op, version, kForwardVersions);  // a typo fails anywhere
  if (q.is_meta()) return {out, lse};
  if (q.is_cuda()) {
#ifdef WITH_CUDA
    // The call's sizes for the rule (its pointers are not read there).
    const AttentionParams sizes = make_varlen_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, scale, causal, window, softcap);
    const std::optional<ForwardVersion> chosen = varlen_forward_rule(sizes, facts_of(q));
    const std::string name = varlen_cuda_rung(op, kForwardVersions, named, chosen, q, k, cu_seqlens_q, max_seqlen_q,
                                              max_seqlen_k, /*backward=*/false);
    const ForwardVersion v_ = named ? *named : *chosen;
    const bool tma = hopper_rung(v_);
    if (tma) {
      check_hopper_rung(op, v_, q, scale);
      TORCH_CHECK(is_listed(kHopperVarlenHeadDims, q.size(2)), op, ": version '", name, "' takes the packed ",
                  "(varlen) layout at head_dim ", list_text(kHopperVarlenHeadDims), "; head_dim is ",
                  std::to_string(q.size(2)), ": use version='split_kv'");
      TORCH_CHECK(!uses_window_or_softcap(sizes), op, ": version '", name, "' takes no window or softcap in the ",
                  "packed (varlen) layout; versions 'tuned' and 'split_kv' compute them (version=None picks ",
                  "'split_kv' there)");
    } else {
      check_tensor_core_rung(op, name, q);
    }
    if (out.numel() == 0) return {out, lse};
    const Tensor qa = aligned_for_copies(q, tma), ka = aligned_for_copies(k, tma), va = aligned_for_copies(v, tma);
    const Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
    const AttentionParams p = make_varlen_params(qa, ka, va, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, scale,
                                                 causal, window, softcap);
    // forward_cuda's "tuned" and "split_kv" (its split count from the max lengths and its partials'
    // workspace, a row per lse row) and "persistent" (its counter and schedule), packed or not.
    FLASH_ATTENTION_ON_CUDA(op, q, forward_cuda(v_, p, q, stream));
#else
    FLASH_ATTENTION_ON_CUDA(op, q, (void)0);
#endif
    return {out, lse};
  }
  const auto sq = seqlen_offsets(op, "cu_seqlens_q", cu_seqlens_q, q.size(0), max_seqlen_q, "max_seqlen_q");
  const auto sk = seqlen_offsets(op, "cu_seqlens_k", cu_seqlens_k, k.size(0), max_seqlen_k, "max_seqlen_k");
  for (size_t b = 0; b + 1 < sq.size(); ++b) {
    const int64_t len_q = sq[b + 1] - sq[b], len_k = sk[b + 1] - sk[b];
    if (len_q == 0) continue;  // no rows: nothing to write
    // The reference writes lse as a contiguous (1, heads, len_q) block; lse's rows are total_q apart.
    Tensor lse_b = at::empty({1, q.size(1), len_q}, lse.options());
    const AttentionParams p =
        make_params(as_batch_of_one(q, sq[b], len_q), as_batch_of_one(k, sk[b], len_k),
                    as_batch_of_one(v, sk[b], len_k), as_batch_of_one(out, sq[b], len_q), lse_b, scale, causal,
                    window, softcap);
    attention_forward_cpu(p);
    lse.narrow(1, sq[b], len_q).copy_(lse_b[0]);
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_backward_impl(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
    bool causal, at::IntArrayRef window, double softcap, OptVersion version) {
  const char* op = kVarlenBackward;
  check_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_window_softcap(op, window, softcap);
  check_packed(op, "grad_out", grad_out);
  check_packed(op, "out", out);
  check_backward_saved(op, "attention_varlen_forward", grad_out, out, lse, q);
  TORCH_CHECK(lse.dim() == 2 && lse.sym_size(0) == q.sym_size(1) && lse.sym_size(1) == q.sym_size(0), op,
              ": lse has shape ", shape_of(lse), " but must be (heads, total_q) of q ", shape_of(q));
  // Every row of dq, and of dk and dv (cu_seqlens_k covers every key token), is written by the
  // backward of its own sequence: empty outputs, as attention_backward's.
  Tensor dq = at::empty_symint(q.sym_sizes(), q.options());
  Tensor dk = at::empty_symint(k.sym_sizes(), k.options());
  Tensor dv = at::empty_symint(v.sym_sizes(), v.options());
  [[maybe_unused]] const auto named = ::course::parse_version(op, version, kBackwardVersions);  // a typo fails anywhere
  if (q.is_meta()) return {dq, dk, dv};
  if (q.is_cuda()) {
#ifdef WITH_CUDA
    // The call's sizes for the rule (its pointers are not read there).
    const AttentionParams sizes = make_varlen_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, scale, causal, window, softcap);
    const std::optional<BackwardVersion> chosen =
        varlen_backward_rule(sizes, at::globalContext().deterministicAlgorithms(), facts_of(q));
    const std::string name = varlen_cuda_rung(op, kBackwardVersions, named, chosen, q, k, cu_seqlens_q, max_seqlen_q,
                                              max_seqlen_k, /*backward=*/true);
    const BackwardVersion v_ = named ? *named : *chosen;
    const bool tma = v_ == BackwardVersion::kWgmma;
    if (tma) {
      check_hopper_backward(op, q);
      TORCH_CHECK(!uses_window_or_softcap(sizes), op, ": version '", name, "' takes no window or softcap in the ",
                  "packed (varlen) layout; versions 'mma' and 'mma_dqpass' compute them (version=None picks ",
                  "'mma_dqpass' there)");
    } else {
      check_tensor_core_rung(op, name, q, /*backward=*/true);
    }
    // TMA's rules for "wgmma" (no stride 0 either), 16-byte copies for the others.
    const Tensor qa = aligned_for_copies(q, tma), ka = aligned_for_copies(k, tma), va = aligned_for_copies(v, tma);
    const Tensor goa = aligned_for_copies(grad_out, tma);
    const Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
    // The kernels index lse as a contiguous (heads, total_q) block.
    const Tensor lse_c = lse.contiguous();
    const AttentionParams fwd = make_varlen_params(qa, ka, va, out, lse_c, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                                   scale, causal, window, softcap);
    AttentionBackwardParams g =
        make_backward_params(fwd, as_batch_of_one(goa, 0, goa.size(0)), as_batch_of_one(dq, 0, dq.size(0)),
                             as_batch_of_one(dk, 0, dk.size(0)), as_batch_of_one(dv, 0, dv.size(0)));
    g.do_batch_stride = g.dq_batch_stride = g.dk_batch_stride = g.dv_batch_stride = 0;
    FLASH_ATTENTION_ON_CUDA(op, q, backward_cuda(v_, g, q, stream));
#else
    FLASH_ATTENTION_ON_CUDA(op, q, (void)0);
#endif
    return {dq, dk, dv};
  }
  const auto sq = seqlen_offsets(op, "cu_seqlens_q", cu_seqlens_q, q.size(0), max_seqlen_q, "max_seqlen_q");
  const auto sk = seqlen_offsets(op, "cu_seqlens_k", cu_seqlens_k, k.size(0), max_seqlen_k, "max_seqlen_k");
  for (size_t b = 0; b + 1 < sq.size(); ++b) {
    const int64_t len_q = sq[b + 1] - sq[b], len_k = sk[b + 1] - sk[b];
    const Tensor lse_b = lse.narrow(1, sq[b], len_q).unsqueeze(0).contiguous();  // the reference's layout
    const Tensor dq_b = as_batch_of_one(dq, sq[b], len_q), dk_b = as_batch_of_one(dk, sk[b], len_k);
    const Tensor dv_b = as_batch_of_one(dv, sk[b], len_k), go_b = as_batch_of_one(grad_out, sq[b], len_q);
    const AttentionParams fwd = make_params(as_batch_of_one(q, sq[b], len_q), as_batch_of_one(k, sk[b], len_k),
                                            as_batch_of_one(v, sk[b], len_k), as_batch_of_one(out, sq[b], len_q),
                                            lse_b, scale, causal, window, softcap);
    const AttentionBackwardParams g = make_backward_params(fwd, go_b, dq_b, dk_b, dv_b);
    attention_backward_cpu(g);  // a sequence without queries still writes its keys' zero gradients
  }
  return {dq, dk, dv};
}

class AttentionVarlenFunction : public torch::autograd::Function<AttentionVarlenFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, double scale, bool causal, at::IntArrayRef window,
                               double softcap, OptVersion version) {
    static auto op =
        ::course::find_op<decltype(attention_varlen_forward_impl)>("flash_attention::attention_varlen_forward");
    Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, lse) = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                   window, softcap, version);
    }
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k});
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    SavedScores{scale, causal, window.vec(), softcap}.save(ctx);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        ::course::find_op<decltype(attention_varlen_backward_impl)>("flash_attention::attention_varlen_backward");
    const auto s = ctx->get_saved_variables();
    Tensor grad_out = grads[0];
    if (grad_out.sym_stride(2) != 1 && grad_out.sym_size(2) != 1) grad_out = grad_out.contiguous();
    const SavedScores m = SavedScores::load(ctx);
    auto [dq, dk, dv] = op.call(grad_out, s[0], s[1], s[2], s[3], s[4], s[5], s[6],
                                ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt(),
                                m.scale, m.causal, m.window, m.softcap, std::nullopt);
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_varlen_forward_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                             const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                             int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                             bool causal, at::IntArrayRef window, double softcap,
                                                             OptVersion version) {
  auto out = AttentionVarlenFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                            causal, window, softcap, version);
  return {out[0], out[1]};
}

// version=None's rules as ops, for flash_attention.default_choice and dispatch_rule: the facts of a
// device passed in, so that any GPU can be asked about on any machine.
std::string forward_rule_op(int64_t batch, int64_t heads, int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k,
                            int64_t head_dim, double scale, bool causal, bool cuda, bool half, int64_t cc_major,
                            int64_t cc_minor, int64_t sms, bool hopper_built, at::IntArrayRef window,
                            double softcap) {
  check_window_softcap("forward_rule", window, softcap);
  AttentionParams p{};
  p.batch = batch, p.heads = heads, p.heads_kv = heads_kv, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.head_dim = head_dim, p.scale = scale, p.causal = causal;
  p.window_left = window[0], p.window_right = causal ? 0 : window[1], p.softcap = softcap;
  const DispatchFacts f{cuda, half, static_cast<int>(cc_major), static_cast<int>(cc_minor), static_cast<int>(sms),
                        hopper_built};
  return ::course::version_name(kForwardVersions, forward_rule(p, f));
}
// The packed layout's: the rung's name, or "" where no rung takes it (the CPU runs the reference,
// CUDA refuses the call). batch is the sequence count, max_seqlen_q and max_seqlen_k the call's.
std::string varlen_rule_op(std::string_view op, int64_t batch, int64_t heads, int64_t heads_kv, int64_t max_seqlen_q,
                           int64_t max_seqlen_k, int64_t head_dim, double scale, bool causal, bool cuda, bool half,
                           int64_t cc_major, int64_t cc_minor, int64_t sms, bool hopper_built,
                           at::IntArrayRef window, double softcap, bool deterministic) {
  check_window_softcap("varlen_rule", window, softcap);
  const DispatchFacts f{cuda, half, static_cast<int>(cc_major), static_cast<int>(cc_minor), static_cast<int>(sms),
                        hopper_built};
  AttentionParams p{};
  p.batch = batch, p.heads = heads, p.heads_kv = heads_kv, p.seqlen_q = max_seqlen_q, p.seqlen_k = max_seqlen_k;
  p.head_dim = head_dim, p.scale = scale, p.causal = causal;
  p.window_left = window[0], p.window_right = causal ? 0 : window[1], p.softcap = softcap;
  if (op == kVarlenForward) {
    const auto v = varlen_forward_rule(p, f);
    return v ? ::course::version_name(kForwardVersions, *v) : "";
  }
  TORCH_CHECK(op == kVarlenBackward, "varlen_rule: unknown op '", std::string(op), "' (", kVarlenForward, " or ",
              kVarlenBackward, ")");
  const auto v = varlen_backward_rule(p, deterministic, f);
  return v ? ::course::version_name(kBackwardVersions, *v) : "";
}
std::string backward_rule_op(int64_t head_dim, bool cuda, bool half, int64_t cc_major, int64_t cc_minor,
                             bool hopper_built, bool causal, at::IntArrayRef window, double softcap,
                             bool deterministic) {
  check_window_softcap("backward_rule", window, softcap);
  AttentionParams p{};
  p.head_dim = head_dim, p.causal = causal, p.softcap = softcap;
  p.window_left = window[0], p.window_right = causal ? 0 : window[1];
  const DispatchFacts f{cuda, half, static_cast<int>(cc_major), static_cast<int>(cc_minor), 0, hopper_built};
  return ::course::version_name(kBackwardVersions, backward_rule(p, deterministic, f));
}

// Whether this build holds part 3's sm_90a kernels (its arch list had 9.0): the tests and the
// benchmark ask, rather than guess from the GPU.
bool hopper_kernels_built_op() {
#ifdef COURSE_HOPPER
  return true;
#else
  return false;
#endif
}

// The grid rule of the tensor-core backward's grid-stride kernels (attention.h), as an op so that
// the tests can hold it to made-up SM counts on any machine, a GPU's or not.
int64_t grid_stride_blocks_op(int64_t work, int64_t per_block, int64_t sms) {
  TORCH_CHECK(per_block >= 1 && sms >= 1, "grid_stride_blocks: per_block and sms must be >= 1 (got ",
              std::to_string(per_block), " and ", std::to_string(sms), ")");
  return grid_stride_blocks(work, per_block, static_cast<int>(sms));
}

// The persistent rung's tile order (hopper/tile_schedule.h) for a problem on a GPU with an L2 of
// `l2_bytes`, as an op so that the tests can hold it to made-up GPUs on any machine: one row per
// tile in the order the blocks draw them, (batch, head, query tile).
Tensor hopper_tile_order_op(int64_t batch, int64_t heads, int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k,
                            int64_t head_dim, bool causal, int64_t l2_bytes, at::IntArrayRef window, double softcap) {
  constexpr const char* op = "hopper_tile_order";
  check_window_softcap(op, window, softcap);
  TORCH_CHECK(batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0 && l2_bytes >= 0 && head_dim >= 1 && heads_kv >= 1 &&
                  heads >= heads_kv && heads % heads_kv == 0,
              op, ": needs batch, seqlen_q, seqlen_k and l2_bytes >= 0, head_dim >= 1 and heads a whole multiple of ",
              "heads_kv (got batch ", std::to_string(batch), ", heads ", std::to_string(heads), "/",
              std::to_string(heads_kv), ", seqlen ", std::to_string(seqlen_q), "/", std::to_string(seqlen_k),
              ", head_dim ", std::to_string(head_dim), ", l2_bytes ", std::to_string(l2_bytes), ")");
  const int64_t tiles = ::course::ceil_div(seqlen_q, int64_t{kHopperBlockM}) * batch * heads;
  TORCH_CHECK(tiles <= (int64_t{1} << 24), op, ": at most 2^24 tiles here (got ", std::to_string(tiles), ")");
  AttentionParams p{};
  p.batch = batch, p.heads = heads, p.heads_kv = heads_kv, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.head_dim = head_dim, p.causal = causal;
  p.window_left = window[0], p.window_right = causal ? 0 : window[1], p.softcap = softcap;  // make_params' rule
  const HopperTileSchedule s = hopper_tile_schedule(p, l2_bytes);
  Tensor order = at::empty({tiles, 3}, at::kLong);
  auto rows = order.accessor<int64_t, 2>();
  for (int index = 0; index < s.tiles; ++index) {
    int pair = 0, q_tile = 0;
    // The decode of the kernel this call runs: the kWindowSoftcap one's with a window or softcap.
    if (s.windowed) {
      hopper_window_tile_at(s, index, &pair, &q_tile);
    } else {
      hopper_tile_at(s, index, &pair, &q_tile);
    }
    rows[index][0] = pair / heads;
    rows[index][1] = pair % heads;
    rows[index][2] = q_tile;
  }
  return order;
}

// The persistent rung's order in the packed layout (hopper/tile_schedule.h's varlen order), for query
// lengths given on the host: what the schedule kernel and the producer work out on the device from
// cu_seqlens_q, with the same functions. One row per work item in the order the blocks draw them,
// (sequence, head, query tile); no row past a sequence's end.
Tensor hopper_varlen_tile_order_op(at::IntArrayRef lengths_q, int64_t heads, int64_t max_seqlen_q) {
  constexpr const char* op = "hopper_varlen_tile_order";
  TORCH_CHECK(heads >= 1 && max_seqlen_q >= 0, op, ": needs heads >= 1 and max_seqlen_q >= 0 (got ",
              std::to_string(heads), " and ", std::to_string(max_seqlen_q), ")");
  const int batch = static_cast<int>(lengths_q.size());
  const int64_t q_tiles64 = ::course::ceil_div(max_seqlen_q, int64_t{kHopperBlockM});
  TORCH_CHECK(q_tiles64 * batch * heads <= (int64_t{1} << 24), op, ": at most 2^24 tiles here");
  const int q_tiles = static_cast<int>(q_tiles64);
  std::vector<int> tiles(batch), order(batch), rank_start(q_tiles + 1);
  for (int b = 0; b < batch; ++b) tiles[b] = hopper_varlen_tiles(lengths_q[b], q_tiles);
  for (int b = 0; b < batch; ++b) {  // the schedule kernel's places, one sequence at a time
    int place = 0;
    for (int c = 0; c < batch; ++c) place += hopper_varlen_before(tiles[c], c, tiles[b], b) ? 1 : 0;
    order[place] = b;
  }
  for (int rank = 0; rank <= q_tiles; ++rank) {
    int64_t items = 0;
    for (int b = 0; b < batch; ++b) items += hopper_varlen_items_before(tiles[b], q_tiles, rank);
    rank_start[rank] = static_cast<int>(items * heads);
  }
  const int total = rank_start[q_tiles];
  Tensor result = at::empty({total, 3}, at::kLong);
  auto rows = result.accessor<int64_t, 2>();
  int rank = 0;
  for (int index = 0; index < total; ++index) {  // one block drawing every index, in order
    const int value = hopper_varlen_item(index, &rank, q_tiles, static_cast<int>(heads), rank_start.data(),
                                         order.data());
    const int pair = value / q_tiles;
    rows[index][0] = pair / heads;
    rows[index][1] = pair % heads;
    rows[index][2] = value % q_tiles;
  }
  return result;
}

void register_backend_kernels(torch::Library& m) {
  m.impl("attention_forward", &attention_forward_impl);
  m.impl("attention_backward", &attention_backward_impl);
  m.impl("attention_varlen_forward", &attention_varlen_forward_impl);
  m.impl("attention_varlen_backward", &attention_varlen_backward_impl);
}

}  // namespace

// For the library's one `versions` op (flash_attention_ops.cpp).
std::optional<std::vector<std::string>> attention_versions(std::string_view op) {
  if (op == kForward) return ::course::version_names(kForwardVersions);
  if (op == kBackward) return ::course::version_names(kBackwardVersions);
  return std::nullopt;
}

}  // namespace flash_attention

// pt2_compliant_tag: the ops promise what torch.compile relies on (schemas that tell the truth
// about aliasing, Meta kernels, registered autograd); test_attention.py holds them to it with
// torch.library.opcheck.
TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  // window and softcap come last, with defaults, so that calls written before they existed still work; the
  // packed ops' version after them, for the same reason.
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, float scale, bool causal=False, str? version=None, "
        "int[2] window=[-1, -1], float softcap=0.0) -> (Tensor out, Tensor lse)",
        pt2);
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "bool causal=False, str? version=None, int[2] window=[-1, -1], float softcap=0.0) "
        "-> (Tensor dq, Tensor dk, Tensor dv)",
        pt2);
  m.def("attention_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float scale, bool causal=False, int[2] window=[-1, -1], "
        "float softcap=0.0, str? version=None) -> (Tensor out, Tensor lse)",
        pt2);
  m.def("attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
        "bool causal=False, int[2] window=[-1, -1], float softcap=0.0, str? version=None) "
        "-> (Tensor dq, Tensor dk, Tensor dv)",
        pt2);
  m.def("grid_stride_blocks(int work, int per_block, int sms) -> int", &flash_attention::grid_stride_blocks_op);
  m.def("hopper_kernels_built() -> bool", &flash_attention::hopper_kernels_built_op);
  m.def("hopper_tile_order(int batch, int heads, int heads_kv, int seqlen_q, int seqlen_k, int head_dim, "
        "bool causal, int l2_bytes, int[2] window=[-1, -1], float softcap=0.0) -> Tensor",
        &flash_attention::hopper_tile_order_op);
  m.def("hopper_varlen_tile_order(int[] lengths_q, int heads, int max_seqlen_q) -> Tensor",
        &flash_attention::hopper_varlen_tile_order_op);
  m.def("forward_rule(int batch, int heads, int heads_kv, int seqlen_q, int seqlen_k, int head_dim, float scale, "
        "bool causal, bool cuda, bool half, int cc_major, int cc_minor, int sms, bool hopper_built, "
        "int[2] window=[-1, -1], float softcap=0.0) -> str",
        &flash_attention::forward_rule_op);
  m.def("backward_rule(int head_dim, bool cuda, bool half, int cc_major, int cc_minor=0, bool hopper_built=False, "
        "bool causal=False, int[2] window=[-1, -1], float softcap=0.0, bool deterministic=False) -> str",
        &flash_attention::backward_rule_op);
  m.def("varlen_rule(str op, int batch, int heads, int heads_kv, int max_seqlen_q, int max_seqlen_k, int head_dim, "
        "float scale, bool causal, bool cuda, bool half, int cc_major, int cc_minor=0, int sms=0, "
        "bool hopper_built=False, int[2] window=[-1, -1], float softcap=0.0, bool deterministic=False) -> str",
        &flash_attention::varlen_rule_op);
}

// CUDA is registered in every build: in a CPU-only build a CUDA tensor gets the checks and then
// course::fail_no_cuda_kernels' clear error rather than the dispatcher's "no kernel for CUDA".
TORCH_LIBRARY_IMPL(flash_attention, CPU, m) { flash_attention::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) { flash_attention::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, Meta, m) { flash_attention::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, Autograd, m) {
  m.impl("attention_forward", &flash_attention::attention_forward_autograd);
  m.impl("attention_varlen_forward", &flash_attention::attention_varlen_forward_autograd);
}
