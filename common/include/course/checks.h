// Named input checks for the torch glue layer (never included by .cu kernel files).
//
// Every message names the op and the problem, e.g.
//   vector_add: a is on cuda:0 but b is on cpu
// The macros stringify the argument names so call sites stay one line:
//   CHECK_SAME_DEVICE("vector_add", a, b);
// They throw c10::Error (RuntimeError in Python) through TORCH_CHECK: never abort the process.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <course/dtype.h>

#include <initializer_list>
#include <string>

namespace course {

// "[4, 3]". Built with std::to_string rather than streaming IntArrayRef: on the course's H100
// image (torch 2.11, Ubuntu 24.04) an extension's own copy of ostream's integer formatting
// crashed against the process's locale (see the README's troubleshooting), and messages must
// never take the process down.
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

inline void check_same_device(const char* op, const char* name_a, const at::Tensor& a,
                              const char* name_b, const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", name_a, " is on ", a.device(), " but ",
              name_b, " is on ", b.device());
}

inline void check_same_dtype(const char* op, const char* name_a, const at::Tensor& a,
                             const char* name_b, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", name_a, " is ", a.scalar_type(),
              " but ", name_b, " is ", b.scalar_type(), " (no implicit type promotion)");
}

inline void check_same_shape(const char* op, const char* name_a, const at::Tensor& a,
                             const char* name_b, const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": ", name_a, " has shape ", shape_str(a.sizes()),
              " but ", name_b, " has shape ", shape_str(b.sizes()),
              " (shapes must match; no broadcasting)");
}

// "the CPU", "CUDA", "meta": where a tensor is, for an error message.
inline std::string device_words(const at::Tensor& t) {
  if (t.device().is_cpu()) return "the CPU";
  if (t.device().is_cuda()) return "CUDA";
  return t.device().str();
}

// The dtype check of every op: the message names the dtype and the device, since what a device
// supports can differ (a 16-bit tensor on the CPU, where a CPU path takes float32 and float64
// only, is told that it runs on CUDA: check_cpu_dtype_in).
inline void check_dtype_in(const char* op, const char* name, const at::Tensor& t,
                           std::initializer_list<at::ScalarType> allowed) {
  for (auto s : allowed) {
    if (t.scalar_type() == s) return;
  }
  std::string list;
  for (auto s : allowed) list += (list.empty() ? "" : ", ") + std::string(c10::toString(s));
  TORCH_CHECK(false, op, ": ", name, " has dtype ", t.scalar_type(), ", which is not supported (",
              "supported: ", list, ") for a tensor on ", device_words(t));
}

// For an op whose CUDA kernels take the 16-bit dtypes but whose CPU path does not: on the CPU,
// only cpu_allowed; a 16-bit tensor there hears "x is a BFloat16 tensor on the CPU; BFloat16 runs
// on CUDA". (Every CPU path of chapters 1-5 takes all four floating dtypes today; this is the one
// place such a limit would be said.)
inline void check_cpu_dtype_in(const char* op, const char* name, const at::Tensor& t,
                               std::initializer_list<at::ScalarType> cpu_allowed) {
  if (!t.device().is_cpu()) return;
  for (auto s : cpu_allowed) {
    if (t.scalar_type() == s) return;
  }
  std::string list;
  for (auto s : cpu_allowed) list += (list.empty() ? "" : ", ") + std::string(c10::toString(s));
  const bool sixteen = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(false, op, ": ", name, " is a ", t.scalar_type(), " tensor on the CPU; the CPU path takes ", list,
              sixteen ? std::string("; ") + c10::toString(t.scalar_type()) + " runs on CUDA" : std::string());
}

// meta tensors carry shapes only: fake-tensor tracing (torch.compile, opcheck) runs the checks
// on them, so they must pass wherever a cpu or cuda tensor would.
inline void check_device_supported(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda() || t.device().is_meta(), op, ": ", name, " is on ", t.device(),
              "; only cpu and cuda tensors are supported");
}

// The four floating dtypes every course op takes: float64 so gradcheck runs on CUDA too.
inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  check_dtype_in(op, name, t, {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble});
}

// Every tensor argument of a course op: defined, on a device the ops serve, a floating dtype.
inline void check_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  check_device_supported(op, name, t);
  check_floating(op, name, t);
}

// The kernels' dtype enum for a tensor that passed check_floating.
inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default: TORCH_CHECK(false, "unreachable: dtype ", t, " passed the checks");
  }
}

// The ATen ScalarType of a kernel dtype: the CPU implementations' way back into ATen's dtype
// dispatch (COURSE_CPU_DISPATCH; at::opmath_type is then the accumulation type, float for the
// 16-bit dtypes, as on the GPU).
inline at::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kFloat64: break;
  }
  return at::kDouble;
}

#define COURSE_CPU_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ::course::to_scalar_type(dtype), name, __VA_ARGS__)

// "[4, 3]" for an error message; a symbolic size (a fake tensor under torch.compile with
// dynamic shapes) as "?". Built with std::to_string, not by streaming the sizes (see above).
inline std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.sym_sizes().size(); ++i) {
    const auto v = t.sym_sizes()[i].maybe_as_int();
    s += (i ? ", " : "") + (v ? std::to_string(*v) : std::string("?"));
  }
  return s + "]";
}

// The error a CUDA tensor meets in an extension that was built without its CUDA kernels.
inline void fail_no_cuda_kernels(const char* op, const char* package) {
  TORCH_CHECK(false, op, ": this build of ", package, " has no CUDA kernels; reinstall it on a "
              "machine with the CUDA toolkit (USE_CUDA=1 python -m pip install --no-build-isolation .)");
}

}  // namespace course

#define CHECK_SAME_DEVICE(op, a, b) ::course::check_same_device(op, #a, a, #b, b)
#define CHECK_SAME_DTYPE(op, a, b) ::course::check_same_dtype(op, #a, a, #b, b)
#define CHECK_SAME_SHAPE(op, a, b) ::course::check_same_shape(op, #a, a, #b, b)
#define CHECK_DTYPE_IN(op, t, ...) ::course::check_dtype_in(op, #t, t, {__VA_ARGS__})
#define CHECK_CPU_DTYPE_IN(op, t, ...) ::course::check_cpu_dtype_in(op, #t, t, {__VA_ARGS__})
#define CHECK_DEVICE_SUPPORTED(op, t) ::course::check_device_supported(op, #t, t)
#define CHECK_FLOATING(op, t) ::course::check_floating(op, #t, t)
