// Route 2, the course's route: the ops registered with PyTorch's dispatcher.
//
//   TORCH_LIBRARY(custom_ops, m)         the schemas: torch.ops.custom_ops.<op> exists, with
//                                        typed arguments that TorchScript, torch.compile and
//                                        torch.export can read without running anything;
//   TORCH_LIBRARY_IMPL(..., CPU/CUDA)    the kernels (kernel_glue.cpp), picked by the inputs'
//                                        device;
//   TORCH_LIBRARY_IMPL(..., Meta)        the same functions on meta tensors: shapes and dtypes
//                                        only, which is all fake-tensor tracing needs;
//   TORCH_LIBRARY_IMPL(..., Autograd)    torch::autograd::Function wrappers, so the backward is
//                                        registered in C++ too, and Python never sees a
//                                        Python-level autograd.Function.
//
// Because every piece is declared to the dispatcher, Dynamo puts a call of the op into its
// graph as one node instead of breaking the graph, AOTAutograd traces the forward and the
// backward through the Meta and Autograd kernels, and torch.library.opcheck can check each
// piece against the others (test_routes.py does).
#include "kernel_glue.h"

#include <ATen/ATen.h>
#include <course/dispatch.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace custom_ops {
namespace library {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::find_op;

// The ops of this library, for `versions`.
constexpr const char* kOps[] = {"fused_op", "fused_op_backward", "custom_relu", "custom_relu_backward",
                                "reduce_sum"};

// Every course library has a `versions` op (common/coursekit/loader.py recognises a loaded
// library by it). This chapter's ops have no ladder of kernel versions: each has one kernel,
// and what the chapter compares is the binding (custom_ops.ROUTES), not the kernel. So the
// answer is an empty list for each op, and an error for a name that is not an op here.
std::vector<std::string> versions(c10::string_view op) {
  const std::string_view name(op.data(), op.size());
  for (const char* known : kOps) {
    if (name == known) return {};
  }
  TORCH_CHECK(false, "versions: unknown op '", std::string(name), "' (custom_ops has fused_op, fused_op_backward, ",
              "custom_relu, custom_relu_backward, reduce_sum)");
}

// Each forward re-enters the dispatcher below the Autograd key (reaching the CPU, CUDA or Meta
// kernel of the op); each backward calls the op's backward op through the dispatcher too, so
// that tracing sees it. First derivatives only: the backward ops have no derivative of their
// own, and a double backward raises.
class FusedOpFunction : public torch::autograd::Function<FusedOpFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& bias, double scale) {
    static auto op = find_op<decltype(fused_op)>("custom_ops::fused_op");
    Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      y = op.call(input, bias, scale);
    }
    // The output, not the input: custom_kernels.h (FusedOpBackwardParams) says why.
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(fused_op_backward)>("custom_ops::fused_op_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dbias] = op.call(grads[0], saved[0], ctx->saved_data["scale"].toDouble());
    return {dx, dbias, Tensor()};
  }
};

class ReluFunction : public torch::autograd::Function<ReluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    static auto op = find_op<decltype(custom_relu)>("custom_ops::custom_relu");
    Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      y = op.call(x);
    }
    ctx->save_for_backward({y});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(custom_relu_backward)>("custom_ops::custom_relu_backward");
    return {op.call(grads[0], ctx->get_saved_variables()[0])};
  }
};

class ReduceSumFunction : public torch::autograd::Function<ReduceSumFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    static auto op = find_op<decltype(reduce_sum)>("custom_ops::reduce_sum");
    // d sum / d x[i] = 1 for every i: the backward needs x's shape only, not x, so x's memory
    // is not kept alive by the graph. Symbolic sizes stay symbolic under torch.compile.
    ctx->saved_data["sizes"] = x.sym_sizes();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // A broadcast view of the 0-d gradient, no copy: what torch.sum's backward returns too.
    return {grads[0].expand_symint(ctx->saved_data["sizes"].toSymIntVector())};
  }
};

Tensor fused_op_autograd(const Tensor& input, const Tensor& bias, double scale) {
  return FusedOpFunction::apply(input, bias, scale);
}
Tensor custom_relu_autograd(const Tensor& x) { return ReluFunction::apply(x); }
Tensor reduce_sum_autograd(const Tensor& x) { return ReduceSumFunction::apply(x); }

// One implementation per op serves CPU, CUDA and Meta: each picks the backend from the
// (already checked) device, so the checks cannot drift apart between backends.
void register_backend_kernels(torch::Library& m) {
  m.impl("fused_op", &fused_op);
  m.impl("fused_op_backward", &fused_op_backward);
  m.impl("custom_relu", &custom_relu);
  m.impl("custom_relu_backward", &custom_relu_backward);
  m.impl("reduce_sum", &reduce_sum);
}

}  // namespace
}  // namespace library
}  // namespace custom_ops

// pt2_compliant_tag: the ops promise what torch.compile relies on (a schema that tells the
// truth about aliasing and mutation, Meta kernels, registered autograd); test_routes.py holds
// them to it with torch.library.opcheck.
TORCH_LIBRARY(custom_ops, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  m.def("versions(str op) -> str[]", &custom_ops::library::versions);
  m.def("fused_op(Tensor input, Tensor bias, float scale) -> Tensor", pt2);
  m.def("fused_op_backward(Tensor grad, Tensor output, float scale) -> (Tensor, Tensor)", pt2);
  m.def("custom_relu(Tensor x) -> Tensor", pt2);
  m.def("custom_relu_backward(Tensor grad, Tensor output) -> Tensor", pt2);
  m.def("reduce_sum(Tensor x) -> Tensor", pt2);
}

// CUDA is registered in every build: in one without CUDA kernels (a CPU-only torch, or no
// toolkit) a CUDA tensor reaches the same functions and gets a clear error from them.
TORCH_LIBRARY_IMPL(custom_ops, CPU, m) { custom_ops::library::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(custom_ops, CUDA, m) { custom_ops::library::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(custom_ops, Meta, m) { custom_ops::library::register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(custom_ops, Autograd, m) {
  m.impl("fused_op", &custom_ops::library::fused_op_autograd);
  m.impl("custom_relu", &custom_ops::library::custom_relu_autograd);
  m.impl("reduce_sum", &custom_ops::library::reduce_sum_autograd);
}
