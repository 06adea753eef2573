// Chapter 5's fused op, relu(input * scale + bias), bound a fourth way: against the LibTorch
// stable ABI. The kernels are the chapter's own (../custom_kernels.h); only the glue differs
// from route 2 (library_ops.cpp over kernel_glue.cpp):
//
//   route 2                               here
//   at::Tensor                            torch::stable::Tensor: a handle whose every method is
//                                         a call of a C function exported by libtorch (the shim)
//   TORCH_LIBRARY, m.impl(name, &fn)      STABLE_TORCH_LIBRARY, m.impl(name, TORCH_BOX(&fn)): a
//                                         boxed C function pointer; arguments cross as
//                                         StableIValue, never as C++ objects
//   at::empty, Tensor::contiguous         torch::stable::new_empty, torch::stable::contiguous
//   c10::cuda::CUDAGuard                  torch::stable::accelerator::DeviceGuard
//   getCurrentCUDAStream, C10_CUDA_CHECK  the C shim's current stream, STD_CUDA_CHECK
//   torch::autograd::Function, Meta       Python (custom_ops_stable/__init__.py): the stable
//                                         ABI has no autograd, and no symbolic sizes (SymInt)
//                                         for a Meta kernel to keep dynamic shapes symbolic
//
// Every libtorch entry point this file reaches is an extern "C" function, so this glue does not
// depend on the layout or the mangled names of any libtorch C++ class: built once, it loads into
// every torch from its target version on. test_stable_abi.py reads the undefined symbols of the
// glue and of the whole library to check it (the kernels and the CPU twin compiled into it are
// torch-free too: the twin uses only header-only types).
//
// The op's namespace is custom_ops_stable, not custom_ops: a namespace has one owner, and route
// 2's TORCH_LIBRARY block owns that one.

// The oldest torch the binary must load into, as a minor version of torch 2. The stable headers
// expose only what that version had (torch/csrc/stable/version.h: TORCH_TARGET_VERSION), so
// building against a newer torch cannot pull in a newer shim function by accident. Defined
// here, in the one file that talks to libtorch, rather than with -D for the whole extension:
// the kernels and the CPU twin are shared with the classic library and know nothing of it.
//
// 2.11 is the course's torch. 2.10 is the oldest that has everything below: TORCH_BOX over
// torch_library_impl, Tensor::const_data_ptr / mutable_data_ptr, new_empty and contiguous with
// their full arguments, str and list boxing (the versions op), and STD_CUDA_CHECK.
#ifndef STABLE_ABI_TARGET_MINOR
#define STABLE_ABI_TARGET_MINOR 11
#endif
// Our own spelling of a version number: torch's TORCH_VERSION_2_1x_0 macros exist only from the
// release that introduced them on, and a macro missing from an #if reads as 0, which would turn
// "target >= 2.13" true on torch 2.11.
#define STABLE_ABI_VERSION(major, minor) (((0ULL + (major)) << 56) | ((0ULL + (minor)) << 48))
#define TORCH_TARGET_VERSION STABLE_ABI_VERSION(2, STABLE_ABI_TARGET_MINOR)
// Every torch header outside torch/csrc/stable and torch/headeronly then refuses to compile, so
// an ATen or c10 include here fails the build instead of linking a C++ symbol of libtorch.
#define TORCH_STABLE_ONLY

#ifdef WITH_CUDA
// The switch under which torch's C shim header declares its CUDA functions (the current CUDA
// stream, STD_CUDA_CHECK's message helper). torch's extension builds do not define it.
#ifndef USE_CUDA
#define USE_CUDA
#endif
#endif

#if !__has_include(<torch/headeronly/version.h>)
#error "custom_ops_stable needs torch >= 2.10: this torch has no torch/headeronly/version.h, so no usable stable ABI"
#endif
#include <torch/headeronly/version.h>
#if !defined(TORCH_ABI_VERSION)
#error "custom_ops_stable needs torch >= 2.10: torch/headeronly/version.h does not define TORCH_ABI_VERSION"
#elif TORCH_ABI_VERSION < TORCH_TARGET_VERSION
#error "the installed torch is older than the target (STABLE_ABI_TARGET_MINOR): lower the target to it"
#endif
#if STABLE_ABI_TARGET_MINOR < 10
#error "STABLE_ABI_TARGET_MINOR < 10: the op needs torch 2.10's stable ABI (stable_ops.cpp says why)"
#endif

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include "../custom_kernels.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace custom_ops_stable {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using DType = ::course::DType;

constexpr const char* kFusedOp = "custom_ops_stable::fused_op";
constexpr const char* kFusedOpBackward = "custom_ops_stable::fused_op_backward";
constexpr const char* kOps[] = {"fused_op", "fused_op_backward"};

// An error message from strings only. Not STD_TORCH_CHECK: it streams __LINE__ through an
// ostringstream in this library, and on the course's H100 image, whose compiler links libstdc++
// statically into extensions, an extension's own integer formatting crashed the process (the
// course README's troubleshooting). Numbers reach messages through std::to_string instead.
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string text;
  ((text += parts), ...);
  return text;
}

// Throws std::runtime_error (RuntimeError in Python), as STD_TORCH_CHECK does; the message is
// only built when the check fails.
#define STABLE_OPS_CHECK(cond, ...)                                                   \
  do {                                                                                \
    if (!(cond)) throw std::runtime_error(::custom_ops_stable::message(__VA_ARGS__)); \
  } while (0)

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

std::string device_str(const torch::stable::Device& device) {
  std::string type;
  switch (device.type()) {
    case torch::headeronly::DeviceType::CPU: return "cpu";
    case torch::headeronly::DeviceType::CUDA: type = "cuda"; break;
    case torch::headeronly::DeviceType::Meta: return "meta";
    default: type = "device type " + std::to_string(static_cast<int>(device.type())); break;
  }
  return device.has_index() ? type + ":" + std::to_string(device.index()) : type;
}

// The kernels' dtype of a tensor the op takes: float32, float16, bfloat16 or float64.
DType kernel_dtype(const char* op, const char* name, const Tensor& t) {
  const ScalarType s = t.scalar_type();
  STABLE_OPS_CHECK(s == ScalarType::Float || s == ScalarType::Half || s == ScalarType::BFloat16 ||
                       s == ScalarType::Double,
                   op, ": ", name, " has dtype ", torch::headeronly::toString(s),
                   ", which is not supported (supported: float32, float16, bfloat16, float64)");
  switch (s) {
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Double: return DType::kFloat64;
    default: return DType::kFloat32;
  }
}

// Two tensors one op combines: same device, same dtype. Returns their kernel dtype.
DType check_pair(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b) {
  const DType dtype = kernel_dtype(op, name_a, a);
  kernel_dtype(op, name_b, b);
  STABLE_OPS_CHECK(a.device() == b.device(), op, ": ", name_a, " is on ", device_str(a.device()), " but ", name_b,
                   " is on ", device_str(b.device()));
  STABLE_OPS_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", name_a, " is ",
                   torch::headeronly::toString(a.scalar_type()), " but ", name_b, " is ",
                   torch::headeronly::toString(b.scalar_type()), " (no implicit type promotion)");
  return dtype;
}

#ifdef WITH_CUDA
// The stream the caller's PyTorch code is on (never the default stream: the caller's streams and
// CUDA graph capture must see the work).
cudaStream_t current_cuda_stream([[maybe_unused]] const char* op, torch::stable::accelerator::DeviceIndex index) {
#if TORCH_TARGET_VERSION >= STABLE_ABI_VERSION(2, 13)
  return static_cast<cudaStream_t>(torch::stable::accelerator::getCurrentStream(index).nativeHandle());
#else
  // Before 2.13, torch::stable::accelerator::Stream has no nativeHandle() (it calls
  // torch_stream_native_handle, a shim function of 2.13): a stable Stream cannot hand out its
  // cudaStream_t. The AOTI C shim's CUDA function can, in every torch this op supports.
  void* stream = nullptr;
  STABLE_OPS_CHECK(aoti_torch_get_current_cuda_stream(index, &stream) == AOTI_TORCH_SUCCESS, op,
                   ": could not get the current CUDA stream of cuda:", std::to_string(index));
  return static_cast<cudaStream_t>(stream);
#endif
}

// Runs the statement(s) after `t` with `stream` bound to t's device's current stream, under a
// guard for t's device.
#define STABLE_OPS_ON_CUDA(op, t, ...)                                                    \
  do {                                                                                    \
    const torch::stable::accelerator::DeviceGuard device_guard((t).get_device_index()); \
    const cudaStream_t stream = current_cuda_stream(op, (t).get_device_index());         \
    __VA_ARGS__;                                                                          \
  } while (0)
#else
// A CPU-only build: the launchers do not exist, so the statement is compiled out.
#define STABLE_OPS_ON_CUDA(op, t, ...)                                                                    \
  throw std::runtime_error(message(op, ": this build of custom_ops_stable has no CUDA kernels; rebuild it " \
                                   "on a machine with the CUDA toolkit and a CUDA build of torch (USE_CUDA=1)"))
#endif

bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  return true;
}

Tensor fused_op(const Tensor& input, const Tensor& bias, double scale) {
  const char* op = kFusedOp;
  const DType dtype = check_pair(op, "input", input, "bias", bias);
  STABLE_OPS_CHECK(input.dim() >= 1, op, ": input is 0-d; it needs a last dim for the bias to run along");
  const int64_t n = input.size(input.dim() - 1);
  STABLE_OPS_CHECK(bias.dim() == 1 && bias.size(0) == n, op, ": bias has shape ", shape_str(bias),
                   " but input has shape ", shape_str(input), "; bias must be 1-D with input.size(-1) elements");
  Tensor y = torch::stable::new_empty(input, input.sizes());
  // Empty: nothing to compute, and n may be 0.
  if (input.numel() == 0) return y;
  // Any strides in, contiguous [rows, n] to the kernel; a contiguous input is not copied.
  const Tensor xc = torch::stable::contiguous(input);
  const Tensor bc = torch::stable::contiguous(bias);
  const custom_ops::FusedOpParams p{dtype, xc.const_data_ptr(), bc.const_data_ptr(), scale, y.mutable_data_ptr(),
                                    input.numel() / n, n};
  if (input.is_cuda()) {
    STABLE_OPS_ON_CUDA(op, input, STD_CUDA_CHECK(custom_ops::launch_fused_op(p, stream)));
  } else {
    custom_ops::fused_op_cpu(p);
  }
  return y;
}

std::tuple<Tensor, Tensor> fused_op_backward(const Tensor& grad, const Tensor& output, double scale) {
  const char* op = kFusedOpBackward;
  const DType dtype = check_pair(op, "grad", grad, "output", output);
  STABLE_OPS_CHECK(grad.dim() >= 1, op, ": grad is 0-d, but fused_op's output has at least one dim");
  STABLE_OPS_CHECK(same_shape(grad, output), op, ": grad has shape ", shape_str(grad), " but output has shape ",
                   shape_str(output), " (they must match)");
  const int64_t n = grad.size(grad.dim() - 1);
  Tensor dx = torch::stable::new_empty(grad, grad.sizes());
  // No rows: no gradient flows into the bias, which is 0, not uninitialized.
  if (grad.numel() == 0) return {dx, torch::stable::new_zeros(grad, n)};
  Tensor dbias = torch::stable::new_empty(grad, n);
  const Tensor gc = torch::stable::contiguous(grad);
  const Tensor yc = torch::stable::contiguous(output);
  custom_ops::FusedOpBackwardParams p{dtype, gc.const_data_ptr(), yc.const_data_ptr(), scale, dx.mutable_data_ptr(),
                                      dbias.mutable_data_ptr(), nullptr, grad.numel() / n, n};
  if (grad.is_cuda()) {
    STABLE_OPS_ON_CUDA(op, grad, {
      int64_t bytes = 0;
      STD_CUDA_CHECK(custom_ops::fused_op_backward_workspace(p, &bytes));
      // From the caching allocator on the current stream, freed when `scratch` goes: the next
      // user of the memory on this stream runs after the kernels that read it.
      const Tensor scratch = torch::stable::new_empty(grad, bytes, ScalarType::Byte);
      p.workspace = scratch.mutable_data_ptr();
      STD_CUDA_CHECK(custom_ops::launch_fused_op_backward(p, stream));
    });
  } else {
    custom_ops::fused_op_backward_cpu(p);
  }
  return {dx, dbias};
}

// Every course library has a `versions` op: common/coursekit/loader.py recognises a loaded
// library by it. The fused op has no ladder of kernel versions, so each op lists none.
std::vector<std::string> versions(std::string op) {
  for (const char* known : kOps) {
    if (op == known) return {};
  }
  throw std::runtime_error(
      message("versions: unknown op '", op, "' (custom_ops_stable has fused_op, fused_op_backward)"));
}

// The torch version this binary was built to load into: [2, minor]. Python reads it to say what
// the build promises (custom_ops_stable.TARGET), and the tests hold the library's shim imports
// to it.
std::vector<int64_t> target_version() { return {2, STABLE_ABI_TARGET_MINOR}; }

}  // namespace
}  // namespace custom_ops_stable

STABLE_TORCH_LIBRARY(custom_ops_stable, m) {
  m.def("versions(str op) -> str[]");
  m.def("target_version() -> int[]");
#if TORCH_TARGET_VERSION >= STABLE_ABI_VERSION(2, 12)
  // pt2_compliant_tag: the ops promise what torch.compile relies on; opcheck holds them to it.
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  m.def("fused_op(Tensor input, Tensor bias, float scale) -> Tensor", pt2);
  m.def("fused_op_backward(Tensor grad, Tensor output, float scale) -> (Tensor, Tensor)", pt2);
#else
  // Before 2.12 a stable library cannot tag a schema (torch_library_def_with_tags is a 2.12 shim
  // function), so the ops go without pt2_compliant_tag. torch.compile traces them all the same;
  // only torch._dynamo.config.only_allow_pt2_compliant_ops would refuse them.
  m.def("fused_op(Tensor input, Tensor bias, float scale) -> Tensor");
  m.def("fused_op_backward(Tensor grad, Tensor output, float scale) -> (Tensor, Tensor)");
#endif
#if TORCH_TARGET_VERSION >= STABLE_ABI_VERSION(2, 13)
  // Where the ops' fake implementations live: torch's error for a fake tensor that meets an op
  // without one then says to import this module. (torch_library_set_python_module: 2.13.)
  m.set_python_module("custom_ops_stable");
#endif
}

// CUDA is registered in every build: in one without CUDA kernels, a CUDA tensor reaches the same
// functions and gets a clear error from them.
STABLE_TORCH_LIBRARY_IMPL(custom_ops_stable, CPU, m) {
  m.impl("fused_op", TORCH_BOX(&custom_ops_stable::fused_op));
  m.impl("fused_op_backward", TORCH_BOX(&custom_ops_stable::fused_op_backward));
}

STABLE_TORCH_LIBRARY_IMPL(custom_ops_stable, CUDA, m) {
  m.impl("fused_op", TORCH_BOX(&custom_ops_stable::fused_op));
  m.impl("fused_op_backward", TORCH_BOX(&custom_ops_stable::fused_op_backward));
}

// No tensor arguments: no device to dispatch on, so one kernel for every backend.
STABLE_TORCH_LIBRARY_IMPL(custom_ops_stable, CompositeExplicitAutograd, m) {
  m.impl("versions", TORCH_BOX(&custom_ops_stable::versions));
  m.impl("target_version", TORCH_BOX(&custom_ops_stable::target_version));
}
