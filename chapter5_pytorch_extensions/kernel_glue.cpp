// Tensors to kernel calls, shared by every binding route (kernel_glue.h says who calls what).
#include "kernel_glue.h"

#include "custom_kernels.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/on_cuda.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <initializer_list>
#include <string>
#include <utility>

namespace custom_ops {
namespace {

using at::Tensor;
using ::course::check_input;
using ::course::to_dtype;

using ::course::shape_of;

// Two tensors an op combines element by element: checked, same device, same dtype, same shape.
void check_pair(const char* op, const char* name_a, const Tensor& a, const char* name_b, const Tensor& b) {
  check_input(op, name_a, a);
  check_input(op, name_b, b);
  ::course::check_same_device(op, name_a, a, name_b, b);
  ::course::check_same_dtype(op, name_a, a, name_b, b);
  TORCH_CHECK(a.sym_sizes() == b.sym_sizes(), op, ": ", name_a, " has shape ", shape_of(a), " but ", name_b,
              " has shape ", shape_of(b), " (they must match)");
}

#define CUSTOM_OPS_ON_CUDA(op, t, ...) COURSE_ON_CUDA(op, "custom_ops", t, __VA_ARGS__)

// Tensors whose memory a kernel is about to touch. Route 1 is called from Python without the
// dispatcher, so nothing stops a FakeTensor (torch.compile or torch.export tracing, a
// FakeTensorMode) from reaching it: such a tensor claims a cpu or cuda device but has no memory
// behind it, and reading it would crash the process. Through the dispatcher (routes 2 and 3) a
// fake tensor never gets here: fake mode runs the Meta kernel or the registered fake instead.
void check_has_data(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(!t->key_set().has(c10::DispatchKey::Python), op, ": ", name, " is a tensor without data (a FakeTensor ",
                "or another __torch_dispatch__ subclass, as when torch.compile or torch.export traces); the ",
                "pybind11 route cannot be traced: use torch.ops.custom_ops.", op, " (route 2) or the custom_ops_py ",
                "op (route 3), which have fake implementations");
  }
}

#ifdef WITH_CUDA
// Scratch for one launch, sized by the launcher's query. It comes from the caching allocator
// on the current stream and is freed with the returned tensor: stream-ordered, so the next
// user of the memory on that stream runs after the kernels that read it.
template <typename Query>
Tensor workspace(Query query, const Tensor& like) {
  int64_t bytes = 0;
  C10_CUDA_CHECK(query(&bytes));
  return at::empty({bytes}, like.options().dtype(at::kByte));
}
#endif

}  // namespace

Tensor fused_op(const Tensor& input, const Tensor& bias, double scale) {
  constexpr const char* op = "fused_op";
  check_input(op, "input", input);
  check_input(op, "bias", bias);
  ::course::check_same_device(op, "input", input, "bias", bias);
  ::course::check_same_dtype(op, "input", input, "bias", bias);
  TORCH_CHECK(input.dim() >= 1, op, ": input is 0-d; it needs a last dim for the bias to run along");
  TORCH_CHECK(bias.dim() == 1 && bias.sym_size(0) == input.sym_size(-1), op, ": bias has shape ", shape_of(bias),
              " but input has shape ", shape_of(input), "; bias must be 1-D with input.size(-1) elements");
  Tensor y = at::empty_symint(input.sym_sizes(), input.options());
  // meta: the shape is the whole answer. Empty: nothing to compute, and n may be 0.
  if (input.is_meta() || input.numel() == 0) return y;
  check_has_data(op, {{"input", &input}, {"bias", &bias}});
  const Tensor xc = input.contiguous();
  const Tensor bc = bias.contiguous();
  const int64_t n = input.size(-1);
  const FusedOpParams p{to_dtype(input.scalar_type()), xc.const_data_ptr(), bc.const_data_ptr(), scale,
                        y.mutable_data_ptr(), input.numel() / n, n};
  if (input.is_cuda()) {
    CUSTOM_OPS_ON_CUDA(op, input, C10_CUDA_CHECK(launch_fused_op(p, stream)));
  } else {
    fused_op_cpu(p);
  }
  return y;
}

std::tuple<Tensor, Tensor> fused_op_backward(const Tensor& grad, const Tensor& output, double scale) {
  constexpr const char* op = "fused_op_backward";
  check_pair(op, "grad", grad, "output", output);
  TORCH_CHECK(grad.dim() >= 1, op, ": grad is 0-d, but fused_op's output has at least one dim");
  Tensor dx = at::empty_symint(grad.sym_sizes(), grad.options());
  if (grad.is_meta()) return {dx, at::empty_symint({grad.sym_size(-1)}, grad.options())};
  // No rows: no gradient flows into the bias, which is 0, not uninitialized.
  if (grad.numel() == 0) return {dx, at::zeros({grad.size(-1)}, grad.options())};
  check_has_data(op, {{"grad", &grad}, {"output", &output}});
  Tensor dbias = at::empty({grad.size(-1)}, grad.options());
  const Tensor gc = grad.contiguous();
  const Tensor yc = output.contiguous();
  const int64_t n = grad.size(-1);
  FusedOpBackwardParams p{to_dtype(grad.scalar_type()), gc.const_data_ptr(), yc.const_data_ptr(), scale,
                          dx.mutable_data_ptr(), dbias.mutable_data_ptr(), nullptr, grad.numel() / n, n};
  if (grad.is_cuda()) {
    CUSTOM_OPS_ON_CUDA(op, grad, {
      const Tensor scratch = workspace([&](int64_t* b) { return fused_op_backward_workspace(p, b); }, grad);
      p.workspace = scratch.data_ptr();
      C10_CUDA_CHECK(launch_fused_op_backward(p, stream));
    });
  } else {
    fused_op_backward_cpu(p);
  }
  return {dx, dbias};
}

Tensor custom_relu(const Tensor& x) {
  constexpr const char* op = "custom_relu";
  check_input(op, "x", x);
  Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || x.numel() == 0) return y;
  check_has_data(op, {{"x", &x}});
  const Tensor xc = x.contiguous();
  const ReluParams p{to_dtype(x.scalar_type()), xc.const_data_ptr(), y.mutable_data_ptr(), x.numel()};
  if (x.is_cuda()) {
    CUSTOM_OPS_ON_CUDA(op, x, C10_CUDA_CHECK(launch_relu(p, stream)));
  } else {
    relu_cpu(p);
  }
  return y;
}

Tensor custom_relu_backward(const Tensor& grad, const Tensor& output) {
  constexpr const char* op = "custom_relu_backward";
  check_pair(op, "grad", grad, "output", output);
  Tensor dx = at::empty_symint(grad.sym_sizes(), grad.options());
  if (grad.is_meta() || grad.numel() == 0) return dx;
  check_has_data(op, {{"grad", &grad}, {"output", &output}});
  const Tensor gc = grad.contiguous();
  const Tensor yc = output.contiguous();
  const ReluBackwardParams p{to_dtype(grad.scalar_type()), gc.const_data_ptr(), yc.const_data_ptr(),
                             dx.mutable_data_ptr(), grad.numel()};
  if (grad.is_cuda()) {
    CUSTOM_OPS_ON_CUDA(op, grad, C10_CUDA_CHECK(launch_relu_backward(p, stream)));
  } else {
    relu_backward_cpu(p);
  }
  return dx;
}

Tensor reduce_sum(const Tensor& x) {
  constexpr const char* op = "reduce_sum";
  check_input(op, "x", x);
  Tensor out = at::empty({}, x.options());
  if (x.is_meta()) return out;
  check_has_data(op, {{"x", &x}});
  const Tensor xc = x.contiguous();
  // Empty x is not special-cased: both backends write 0 for it.
  ReduceSumParams p{to_dtype(x.scalar_type()), xc.const_data_ptr(), x.numel(), out.mutable_data_ptr(), nullptr};
  if (x.is_cuda()) {
    CUSTOM_OPS_ON_CUDA(op, x, {
      const Tensor scratch = workspace([&](int64_t* b) { return reduce_sum_workspace(p, b); }, x);
      p.workspace = scratch.data_ptr();
      C10_CUDA_CHECK(launch_reduce_sum(p, stream));
    });
  } else {
    reduce_sum_cpu(p);
  }
  return out;
}

}  // namespace custom_ops
