// The one place where tensors become kernel calls: input checks, the output allocation, the
// device guard and stream, the launch (or the CPU loop) and its error check. Both C++ binding
// routes call these functions: custom_ops.cpp (pybind11, route 1) directly, library_ops.cpp
// (TORCH_LIBRARY, route 2) by registering them as the ops' CPU, CUDA and Meta kernels. Route 3
// (torch.library.custom_op, custom_ops/_python_op.py) reaches them through route 1's raw entry
// points. So a check or a launch written here holds for every route, and the routes differ
// only in how Python gets here.
//
// Every function takes cpu, cuda and meta tensors of float32, float16, bfloat16 or float64
// (any strides: non-contiguous inputs are copied to contiguous ones first), returns
// contiguous tensors of the input's dtype, and throws c10::Error (RuntimeError in Python)
// naming the op and the problem for anything else. Meta tensors (fake-tensor tracing:
// torch.compile, torch.export, opcheck) get outputs of the right shape and no computation.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace custom_ops {

// relu(input * scale + bias); bias is 1-D with input.size(-1) elements.
at::Tensor fused_op(const at::Tensor& input, const at::Tensor& bias, double scale);

// (d input, d bias) of fused_op, from the upstream gradient and the forward's output.
std::tuple<at::Tensor, at::Tensor> fused_op_backward(const at::Tensor& grad, const at::Tensor& output, double scale);

at::Tensor custom_relu(const at::Tensor& x);

// d x of relu, from the upstream gradient and relu's output.
at::Tensor custom_relu_backward(const at::Tensor& grad, const at::Tensor& output);

// The sum of every element of x, a 0-d tensor of x's dtype (0 for an empty x).
at::Tensor reduce_sum(const at::Tensor& x);

}  // namespace custom_ops
