// The torch side of the debugging exercise: one dispatcher op that checks its tensors and
// launches a kernel of off_by_one.cu on the current stream, the way kernel_glue.cpp does for
// the chapter's real ops.
//
// debug_lab.py builds this file three times (release, NDEBUG, and DEBUG=1 with -G), and loads
// two of those builds into one process to time the assert against its absence. Each build
// registers under its own namespace, its extension name (torch's JIT build defines
// TORCH_EXTENSION_NAME as debug_lab_release, debug_lab_ndebug or debug_lab_debug), so the two
// registrations do not collide: torch.ops.debug_lab_release.scale_bias_relu_into and so on.
#include "off_by_one.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <course/checks.h>
#include <torch/library.h>

#include <string>

namespace {

constexpr const char* kOp = "scale_bias_relu_into";

DebugLabKernel kernel_named(c10::string_view name) {
  if (name == "broken") return kBroken;
  if (name == "fixed") return kFixed;
  if (name == "asserted_broken") return kAssertedBroken;
  if (name == "asserted") return kAsserted;
  TORCH_CHECK(false, kOp, ": unknown kernel '", std::string(name.data(), name.size()),
              "'; choose broken, fixed, asserted_broken or asserted");
}

// Writes into y rather than returning a new tensor: the caller decides what lies around y,
// which is the whole exercise (a fresh allocation for compute-sanitizer, a canary element after
// the end for the plain run).
void scale_bias_relu_into(const at::Tensor& x, const at::Tensor& y, double scale, double bias,
                          c10::string_view kernel) {
  const DebugLabKernel which = kernel_named(kernel);
  CHECK_SAME_DEVICE(kOp, x, y);
  TORCH_CHECK(x.is_cuda(), kOp, ": x is on ", x.device(), "; the exercise's kernels run on CUDA only");
  CHECK_DTYPE_IN(kOp, x, at::kFloat);
  CHECK_SAME_DTYPE(kOp, x, y);
  CHECK_SAME_SHAPE(kOp, x, y);
  // The kernels index flat memory, and y is written in place, so a copy would hide the writes.
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), kOp, ": x and y must be contiguous");
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
  C10_CUDA_CHECK(debug_lab_launch(which, x.const_data_ptr<float>(), static_cast<float>(scale),
                                  static_cast<float>(bias), y.mutable_data_ptr<float>(), x.numel(), y.numel(),
                                  stream));
}

}  // namespace

// TORCH_LIBRARY pastes its namespace argument into identifiers without expanding it first; one
// more macro level expands TORCH_EXTENSION_NAME to the build's name before the paste.
#define DEBUG_LAB_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

DEBUG_LAB_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("scale_bias_relu_into(Tensor x, Tensor(a!) y, float scale, float bias, str kernel) -> ()");
  m.impl("scale_bias_relu_into", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(scale_bias_relu_into)));
}
