// Torch glue for part 3's FP8 forward: quantize_fp8 (a tensor to e4m3 with one scale, V transposed
// for the forward; attention/fp8.h) and attention_fp8 (the forward on e4m3 Q, K and V^T;
// hopper/flash_fwd_hopper_fp8.cuh). Their schemas, checks, the CPU/CUDA/Meta kernel of each, and
// the CPU references that define them: quantize in float32 steps that the CUDA kernels repeat bit
// for bit, attention as the float64 attention (attention_forward_cpu) of the dequantized inputs.
// Forward only: no autograd (e4m3 tensors take no gradient).
#include "attention/attention.h"
#include "attention/attention_params.h"
#include "attention/fp8.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/on_cuda.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include "hopper/flash_fwd_hopper.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <string>
#include <tuple>

namespace flash_attention {
namespace {

using at::Tensor;
using ::course::is_listed;
using ::course::list_text;
using ::course::shape_of;

constexpr const char* kQuantize = "quantize_fp8";
constexpr const char* kAttentionFp8 = "attention_fp8";
// The FP8 forward has no window: make_params is given both sides unbounded.
constexpr int64_t kNoWindow[] = {-1, -1};

#define FLASH_ATTENTION_ON_CUDA(op, t, ...) COURSE_ON_CUDA(op, "flash_attention", t, __VA_ARGS__)

// ---------------------------------------------------------------------------------------
// quantize_fp8(x, transpose) -> (x8, descale)
// ---------------------------------------------------------------------------------------
// The CPU reference (attention/fp8.h's steps): the scale and descale as C++ floats, one float32
// multiply per element, torch's e4m3 conversion (round to nearest even, as cuda_fp8.h's).
std::tuple<Tensor, Tensor> quantize_fp8_cpu(const Tensor& x, bool transpose, const Tensor& out) {
  const Tensor xf = x.to(at::kFloat);
  const float amax = xf.numel() > 0 ? xf.abs().max().item<float>() : 0.f;
  const float scale = amax > 0.f ? kE4m3Max / amax : 1.f;
  const float descale = amax > 0.f ? amax / kE4m3Max : 1.f;
  const Tensor x8 = xf.mul(static_cast<double>(scale)).to(at::kFloat8_e4m3fn);  // the float's exact value
  out.copy_(transpose ? x8.transpose(2, 3) : x8);
  return {out, at::full({1}, descale, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor> quantize_fp8_impl(const Tensor& x, bool transpose) {
  const char* op = kQuantize;
  TORCH_CHECK(x.defined(), op, ": x is an undefined tensor");
  ::course::check_device_supported(op, "x", x);
  ::course::check_dtype_in(op, "x", x, {at::kFloat, at::kHalf, at::kBFloat16});
  TORCH_CHECK(!transpose || x.dim() == 4, op, ": transpose=True takes v as (batch, heads_kv, seqlen, head_dim) ",
              "and writes (batch, heads_kv, head_dim, seqlen); x has shape ", shape_of(x));
  const Tensor xc = x.contiguous();  // a one-off preparation of an input: one layout to read
  const auto fp8 = x.options().dtype(at::kFloat8_e4m3fn);
  Tensor out, buffer;
  if (transpose) {
    // V^T with each row of keys padded to 16 bytes (TMA's row-stride rule), zeros past seqlen: the
    // returned tensor is the (batch, heads_kv, head_dim, seqlen) view of that buffer.
    const int64_t seqlen = x.size(2);
    buffer = at::zeros({x.size(0), x.size(1), x.size(3), fp8_transposed_row(seqlen)}, fp8);
    out = buffer.narrow(3, 0, seqlen);
  } else {
    out = at::empty(x.sizes(), fp8);
  }
  Tensor descale = at::empty({1}, x.options().dtype(at::kFloat));
  if (x.is_meta()) return {out, descale};
  if (x.is_cpu()) return quantize_fp8_cpu(xc, transpose, out);
  QuantizeFp8Params p{};
  p.dtype = ::course::to_dtype(x.scalar_type());
  p.x = xc.const_data_ptr();
  // The transposed kernel writes the padding too, so it gets the whole buffer: at seqlen 0 the view
  // has no elements and its data pointer is null, while the buffer's padded rows still exist.
  p.out = transpose ? buffer.mutable_data_ptr() : out.mutable_data_ptr();
  p.descale = descale.mutable_data_ptr<float>();
  p.numel = xc.numel();
  p.transpose = transpose;
  if (transpose) {
    p.rows = x.size(0) * x.size(1), p.seqlen = x.size(2), p.head_dim = x.size(3), p.row_stride = out.stride(2);
  }
  const Tensor amax = at::zeros({1}, x.options().dtype(at::kFloat));  // the amax kernel's atomicMax starts at 0
  p.amax = amax.mutable_data_ptr<float>();
  FLASH_ATTENTION_ON_CUDA(op, x, C10_CUDA_CHECK(launch_quantize_fp8(p, stream)));
  return {out, descale};
}

// ---------------------------------------------------------------------------------------
// attention_fp8(q, k, v_t, descale_q, descale_k, descale_v, scale, causal) -> (out, lse)
// ---------------------------------------------------------------------------------------
void check_e4m3(const char* op, const char* name, const Tensor& t, const char* layout) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_device_supported(op, name, t);
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, op, ": ", name, " has dtype ", t.scalar_type(),
              " but must be Float8_e4m3fn (quantize_fp8 makes it)");
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " has shape ", shape_of(t), " (", std::to_string(t.dim()),
              " dims); it must have 4: ", layout);
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, op, ": ", name, "'s last dim is not contiguous (stride ",
              std::to_string(t.stride(3)), "): pass ", name, ".contiguous()");
}

void check_descale(const char* op, const char* name, const Tensor& d, const Tensor& q) {
  TORCH_CHECK(d.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_same_device(op, name, d, "q", q);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.numel() == 1, op, ": ", name, " must be one float32 (a ",
              "per-tensor factor, as quantize_fp8 returns it); it has dtype ", d.scalar_type(), " and shape ",
              shape_of(d));
}

void check_fp8_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v_t, const Tensor& dq,
                      const Tensor& dk, const Tensor& dv) {
  check_e4m3(op, "q", q, "(batch, heads, seqlen_q, head_dim)");
  check_e4m3(op, "k", k, "(batch, heads_kv, seqlen_k, head_dim)");
  check_e4m3(op, "v_t", v_t, "(batch, heads_kv, head_dim, seqlen_k): V transposed, as quantize_fp8(v, "
             "transpose=True) writes it");
  ::course::check_same_device(op, "k", k, "q", q);
  ::course::check_same_device(op, "v_t", v_t, "q", q);
  TORCH_CHECK(k.size(0) == q.size(0) && v_t.size(0) == q.size(0), op, ": q, k and v_t must have one batch; got ",
              shape_of(q), ", ", shape_of(k), " and ", shape_of(v_t));
  TORCH_CHECK(q.size(3) >= 1 && k.size(3) == q.size(3), op, ": q has head_dim ", std::to_string(q.size(3)),
              " and k ", std::to_string(k.size(3)), " (they must be equal and at least 1)");
  TORCH_CHECK(v_t.size(1) == k.size(1) && v_t.size(2) == k.size(3) && v_t.size(3) == k.size(2), op, ": v_t has shape ",
              shape_of(v_t), " but must be (batch, heads_kv, head_dim, seqlen_k) of k ", shape_of(k),
              " (V transposed: quantize_fp8(v, transpose=True))");
  const int64_t heads = q.size(1), heads_kv = k.size(1);
  TORCH_CHECK(heads_kv >= 1 && heads % heads_kv == 0, op, ": q has ", std::to_string(heads), " heads and k ",
              std::to_string(heads_kv), "; the query heads must be a whole multiple of the kv heads");
  check_descale(op, "descale_q", dq, q);
  check_descale(op, "descale_k", dk, q);
  check_descale(op, "descale_v", dv, q);
}

// The definition: the float64 attention of the dequantized inputs (descale * x8, each e4m3 value
// exact in float64), rounded once to bfloat16 (out) and float32 (lse).
void attention_fp8_cpu(const Tensor& q, const Tensor& k, const Tensor& v_t, const Tensor& dq, const Tensor& dk,
                       const Tensor& dv, double scale, bool causal, const Tensor& out, const Tensor& lse) {
  const Tensor qd = q.to(at::kDouble).mul(dq.to(at::kDouble));
  const Tensor kd = k.to(at::kDouble).mul(dk.to(at::kDouble));
  const Tensor vd = v_t.to(at::kDouble).mul(dv.to(at::kDouble)).transpose(2, 3).contiguous();
  const Tensor o64 = at::empty(q.sizes(), q.options().dtype(at::kDouble));
  const Tensor lse64 = at::empty(lse.sizes(), q.options().dtype(at::kDouble));
  const AttentionParams p = make_params(qd, kd, vd, o64, lse64, scale, causal, kNoWindow, 0.0, DType::kFloat64);
  attention_forward_cpu(p);
  out.copy_(o64);
  lse.copy_(lse64);
}

#ifdef WITH_CUDA
int device_attribute(const Tensor& t, cudaDeviceAttr attr) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, t.device().index()));
  return value;
}

// What the FP8 kernel needs, each refused with the way out: a build with the sm_90a kernels, a
// Hopper GPU, a head dim it was compiled for, a positive scale, the shared memory it takes, and a
// launcher candidate (the bench-only knob) that exists at the head dim.
void check_fp8_cuda(const char* op, const Tensor& q, double scale) {
#ifndef COURSE_HOPPER
  TORCH_CHECK(false, op, ": the FP8 forward is a Hopper kernel (sm_90a), and this build of flash_attention has ",
              "none: it was compiled for a TORCH_CUDA_ARCH_LIST without 9.0. Rebuild with 9.0 in the list, or ",
              "dequantize and call attention()");
#endif
  const int major = device_attribute(q, cudaDevAttrComputeCapabilityMajor);
  const int minor = device_attribute(q, cudaDevAttrComputeCapabilityMinor);
  TORCH_CHECK(major == 9 && minor == 0, op, ": needs a Hopper GPU, compute capability 9.0 (e4m3 wgmma, TMA ",
              "and setmaxnreg; sm_90a code runs on no other); this GPU is ", std::to_string(major), ".",
              std::to_string(minor), ": dequantize and call attention()");
  TORCH_CHECK(is_listed(kFp8HeadDims, q.size(3)), op, ": takes head_dim ", list_text(kFp8HeadDims),
              " on CUDA (a row of Q or K is one 64- or 128-byte swizzle row); head_dim is ",
              std::to_string(q.size(3)));
  TORCH_CHECK(scale > 0.0, op, ": takes scale > 0 (its softmax keeps each row's maximum of the unscaled ",
              "scores, which is the maximum of the scaled ones only for a positive scale); scale is ",
              std::to_string(scale));
#ifdef COURSE_HOPPER
  const int64_t smem = attention_fp8_smem_bytes(q.size(3));
  const int64_t allowed = device_attribute(q, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  TORCH_CHECK(smem <= allowed, op, ": at head_dim ", std::to_string(q.size(3)), " takes ", std::to_string(smem / 1024),
              " KiB of shared memory per block; this GPU allows ", std::to_string(allowed / 1024), " KiB");
  const std::string refusal = attention_fp8_candidate_refusal(q.size(3));
  TORCH_CHECK(refusal.empty(), op, ": ", refusal);
#endif
}

// TMA's rules: the data 16-byte aligned and every stepped stride (dims of size > 1) a non-zero
// multiple of 16 bytes. Q and K of a (batch, seqlen, heads, d) projection pass as they are; a view
// that does not is copied once, contiguous. V^T's rows of keys are padded to 16 bytes if they are
// not (quantize_fp8's output always is).
bool tma_ready(const Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int dim = 0; dim < 3; ++dim) ok = ok && (t.size(dim) == 1 || (t.stride(dim) % 16 == 0 && t.stride(dim) != 0));
  return ok;
}
Tensor for_tma(const Tensor& t) { return tma_ready(t) ? t : t.contiguous(); }
Tensor vt_for_tma(const Tensor& v_t) {
  if (tma_ready(v_t)) return v_t;
  const int64_t seqlen = v_t.size(3);
  const Tensor buffer = at::zeros({v_t.size(0), v_t.size(1), v_t.size(2), fp8_transposed_row(seqlen)}, v_t.options());
  Tensor padded = buffer.narrow(3, 0, seqlen);
  padded.copy_(v_t);
  return padded;
}
#endif

std::tuple<Tensor, Tensor> attention_fp8_impl(const Tensor& q, const Tensor& k, const Tensor& v_t, const Tensor& dq,
                                              const Tensor& dk, const Tensor& dv, double scale, bool causal) {
  const char* op = kAttentionFp8;
  check_fp8_inputs(op, q, k, v_t, dq, dk, dv);
  Tensor out = at::empty(q.sizes(), q.options().dtype(at::kBFloat16));
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.is_meta()) return {out, lse};
  if (q.is_cuda()) {
#ifdef WITH_CUDA
    check_fp8_cuda(op, q, scale);
#else
    ::course::fail_no_cuda_kernels(op, "flash_attention");
#endif
    if (out.numel() == 0) return {out, lse};
#ifdef COURSE_HOPPER
    const Tensor qa = for_tma(q), ka = for_tma(k), va = vt_for_tma(v_t);
    AttentionFp8Params f{};
    // out's dtype: the kernel writes bfloat16 from e4m3 inputs (v is V^T, as make_params says).
    f.attn = make_params(qa, ka, va, out, lse, scale, causal, kNoWindow, 0.0, DType::kBFloat16);
    f.descale_q = dq.const_data_ptr<float>();
    f.descale_k = dk.const_data_ptr<float>();
    f.descale_v = dv.const_data_ptr<float>();
    FLASH_ATTENTION_ON_CUDA(op, q, C10_CUDA_CHECK(launch_attention_fp8_hopper(f, stream)));
#endif
    return {out, lse};  // without the sm_90a kernels check_fp8_cuda has refused the call already
  }
  if (out.numel() > 0) attention_fp8_cpu(q, k, v_t, dq, dk, dv, scale, causal, out, lse);
  return {out, lse};
}

void register_fp8_kernels(torch::Library& m) {
  m.impl("quantize_fp8", &quantize_fp8_impl);
  m.impl("attention_fp8", &attention_fp8_impl);
}

}  // namespace
}  // namespace flash_attention

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
  m.def("quantize_fp8(Tensor x, bool transpose=False) -> (Tensor x8, Tensor descale)");
  m.def("attention_fp8(Tensor q, Tensor k, Tensor v_t, Tensor descale_q, Tensor descale_k, Tensor descale_v, "
        "float scale, bool causal=False) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(flash_attention, CPU, m) { flash_attention::register_fp8_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) { flash_attention::register_fp8_kernels(m); }
TORCH_LIBRARY_IMPL(flash_attention, Meta, m) { flash_attention::register_fp8_kernels(m); }
