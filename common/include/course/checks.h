// Named input checks for the torch glue layer (never included by .cu kernel files).
//
// Every message names the op and the problem, e.g.
//   vector_add: a is on cuda:0 but b is on cpu
// The macros stringify the argument names so call sites stay one line:
//   CHECK_SAME_DEVICE("vector_add", a, b);
// They throw c10::Error (RuntimeError in Python) through TORCH_CHECK: never abort the process.
#pragma once

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

inline void check_dtype_in(const char* op, const char* name, const at::Tensor& t,
                           std::initializer_list<at::ScalarType> allowed) {
  for (auto s : allowed) {
    if (t.scalar_type() == s) return;
  }
  std::string list;
  for (auto s : allowed) list += (list.empty() ? "" : ", ") + std::string(c10::toString(s));
  TORCH_CHECK(false, op, ": ", name, " has dtype ", t.scalar_type(), ", which is not supported (",
              "supported: ", list, ")");
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

// The error a CUDA tensor meets in an extension that was built without its CUDA kernels.
inline void fail_no_cuda_kernels(const char* op, const char* package) {
  TORCH_CHECK(false, op, ": this build of ", package, " has no CUDA kernels; reinstall it on a "
              "machine with the CUDA toolkit (USE_CUDA=1 pip install .)");
}

}  // namespace course

#define CHECK_SAME_DEVICE(op, a, b) ::course::check_same_device(op, #a, a, #b, b)
#define CHECK_SAME_DTYPE(op, a, b) ::course::check_same_dtype(op, #a, a, #b, b)
#define CHECK_SAME_SHAPE(op, a, b) ::course::check_same_shape(op, #a, a, #b, b)
#define CHECK_DTYPE_IN(op, t, ...) ::course::check_dtype_in(op, #t, t, {__VA_ARGS__})
#define CHECK_DEVICE_SUPPORTED(op, t) ::course::check_device_supported(op, #t, t)
#define CHECK_FLOATING(op, t) ::course::check_floating(op, #t, t)
