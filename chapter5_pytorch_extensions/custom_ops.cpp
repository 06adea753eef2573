// Route 1, the classic one (PyTorch's C++ extension tutorial's): a pybind11
// module whose functions Python calls directly, with the backward wired in C++ by a
// torch::autograd::Function. Nothing here is registered with the dispatcher: the functions
// call kernel_glue.cpp (checks, launch) directly.
//
// What that buys: the shortest path from Python to the kernel (one pybind call, no schema
// parsing, no dispatch), and the C++ is ordinary C++.
// What it costs: to PyTorch the function is an opaque builtin. Dynamo cannot see inside it, so
// torch.compile breaks the graph around it (fullgraph=True fails); there is no fake rule for
// the tracers to ask, and a FakeTensor that reaches the glue is refused (it has no memory to
// read), so torch.export cannot take it; and it is not an op, so torch.library.opcheck has
// nothing to check. test_routes.py shows each of these. (Plain meta tensors do work: the glue
// handles them itself.)
//
// The same library also holds route 2's TORCH_LIBRARY registrations (library_ops.cpp): one
// .so can be both a Python module (PyInit_<TORCH_EXTENSION_NAME>, run when Python imports it)
// and a library of dispatcher ops (static registrars, run when it is loaded at all).
//
// fused_op_raw and fused_op_backward_raw are the kernels without autograd: route 3
// (custom_ops/_python_op.py) wraps them in torch.library.custom_op and registers its own
// fake and autograd rules in Python.
#include "kernel_glue.h"

// Not <torch/extension.h>, the tutorial's include: that is all of libtorch's C++ API (torch/all.h:
// nn, optim, data loaders, serialization) plus the Python bindings, and this file was the cold
// build's critical path (labs/build_lab.py on the H100 machine: 41 of the build's 42 s). The two
// headers it uses parse in about half the time (the lesson's build section).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <course/checks.h>

#include <initializer_list>
#include <string>

namespace custom_ops {
namespace pybind_route {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Unlike route 2's Functions (library_ops.cpp), these call the kernels directly, not through
// the dispatcher: nothing between apply() and the launch but the checks.
class FusedOpFunction : public torch::autograd::Function<FusedOpFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& input, const Tensor& bias, double scale) {
    Tensor y = fused_op(input, bias, scale);
    // The output, not the input: custom_kernels.h (FusedOpBackwardParams) says why.
    ctx->save_for_backward({y});
    ctx->saved_data["scale"] = scale;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [dx, dbias] = fused_op_backward(grads[0], ctx->get_saved_variables()[0], ctx->saved_data["scale"].toDouble());
    return {dx, dbias, Tensor()};
  }
};

class ReluFunction : public torch::autograd::Function<ReluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    Tensor y = custom_relu(x);
    ctx->save_for_backward({y});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {custom_relu_backward(grads[0], ctx->get_saved_variables()[0])};
  }
};

class ReduceSumFunction : public torch::autograd::Function<ReduceSumFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    // The backward needs x's shape only (d sum / d x[i] = 1), so x itself is not saved.
    ctx->saved_data["sizes"] = x.sizes();
    return reduce_sum(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].expand(ctx->saved_data["sizes"].toIntVector())};
  }
};

Tensor fused_op_forward(const Tensor& input, const Tensor& bias, double scale) {
  return FusedOpFunction::apply(input, bias, scale);
}
Tensor relu_forward(const Tensor& x) { return ReluFunction::apply(x); }
Tensor reduce_sum_forward(const Tensor& x) { return ReduceSumFunction::apply(x); }

// Arguments of the wrong type. pybind11's own TypeError for a call that fits no signature ends
// with "Invoked with:" and the repr of every argument: for a tensor, its values, which say
// nothing about what was wrong. So each function is bound twice (PYBIND11_MODULE below): the
// typed function, then an overload of AnyObject parameters that names the function, the
// argument and what it got. pybind11 tries every overload once without implicit conversions and
// then once more with them; AnyObject fits only in that second pass, so the overload runs only
// after the typed function failed even with conversions (an int scale still reaches the typed
// function, converted), and a call that fits is taken by the typed function in the first pass.
struct AnyObject {
  pybind11::object object;
};

enum class Kind { tensor, number };

struct Parameter {
  const char* name;
  Kind kind;
  const AnyObject& got;
};

std::string describe(pybind11::handle arg) {
  if (THPVariable_Check(arg.ptr())) {
    const Tensor& t = THPVariable_Unpack(arg.ptr());
    return std::string("a tensor of dtype ") + c10::toString(t.scalar_type()) + " and shape " +
           course::shape_str(t.sizes()) + " on " + t.device().str();
  }
  const std::string type = Py_TYPE(arg.ptr())->tp_name;
  return (std::string("aeiou").find(type[0]) == std::string::npos ? "a " : "an ") + type;
}

bool fits(pybind11::handle arg, Kind kind) {
  if (THPVariable_Check(arg.ptr())) return kind == Kind::tensor;
  if (kind == Kind::tensor) return false;
  // A number is whatever the typed function's double parameter converts (PyFloat_AsDouble).
  PyFloat_AsDouble(arg.ptr());
  if (!PyErr_Occurred()) return true;
  PyErr_Clear();
  return false;
}

[[noreturn]] void refuse(const char* function, std::initializer_list<Parameter> parameters) {
  std::string names;
  for (const Parameter& p : parameters) names += (names.empty() ? "" : ", ") + std::string(p.name);
  for (const Parameter& p : parameters) {
    if (!fits(p.got.object, p.kind)) {
      throw pybind11::type_error(std::string(function) + ": " + p.name + " must be " +
                                 (p.kind == Kind::tensor ? "a tensor" : "a number (float)") + ", got " +
                                 describe(p.got.object) + " (the arguments, in order: " + names + ")");
    }
  }
  throw pybind11::type_error(std::string(function) + ": the arguments fit no signature (in order: " + names + ")");
}

}  // namespace
}  // namespace pybind_route
}  // namespace custom_ops

namespace pybind11::detail {
// AnyObject accepts any Python object, in the conversion pass only (see above).
template <>
struct type_caster<custom_ops::pybind_route::AnyObject> {
  PYBIND11_TYPE_CASTER(custom_ops::pybind_route::AnyObject, const_name("object"));
  bool load(handle src, bool convert) {
    if (!convert) return false;
    value.object = reinterpret_borrow<object>(src);
    return true;
  }
};
}  // namespace pybind11::detail

namespace custom_ops::pybind_route {
namespace {

constexpr const char* kMisuse = "Any other arguments: a TypeError that names the function and the wrong argument.";

// The misuse overload of function(x: tensor).
template <typename Result>
void def_misuse(pybind11::module_& m, const char* function, const char* x) {
  m.def(
      function, [function, x](const AnyObject& got) -> Result { refuse(function, {{x, Kind::tensor, got}}); },
      kMisuse, pybind11::arg(x));
}

// The misuse overload of function(a: tensor, b: tensor, scale: number).
template <typename Result>
void def_misuse(pybind11::module_& m, const char* function, const char* a, const char* b, const char* scale) {
  m.def(
      function,
      [=](const AnyObject& got_a, const AnyObject& got_b, const AnyObject& got_scale) -> Result {
        refuse(function, {{a, Kind::tensor, got_a}, {b, Kind::tensor, got_b}, {scale, Kind::number, got_scale}});
      },
      kMisuse, pybind11::arg(a), pybind11::arg(b), pybind11::arg(scale));
}

}  // namespace
}  // namespace custom_ops::pybind_route

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace custom_ops::pybind_route;
  m.doc() = "Chapter 5, route 1: the kernels bound with pybind11, autograd in C++ (custom_ops.cpp).";
  m.def("fused_op_forward", &fused_op_forward,
        "relu(input * scale + bias), differentiable in input and bias (a C++ autograd Function).",
        py::arg("input"), py::arg("bias"), py::arg("scale"));
  def_misuse<at::Tensor>(m, "fused_op_forward", "input", "bias", "scale");
  m.def("custom_relu", &relu_forward, "relu(x), differentiable.", py::arg("x"));
  def_misuse<at::Tensor>(m, "custom_relu", "x");
  m.def("reduce_sum", &reduce_sum_forward, "The sum of every element of x as a 0-d tensor, differentiable.",
        py::arg("x"));
  def_misuse<at::Tensor>(m, "reduce_sum", "x");
  m.def("fused_op_raw", &custom_ops::fused_op,
        "fused_op's kernel without autograd: relu(input * scale + bias). Route 3 wraps it.", py::arg("input"),
        py::arg("bias"), py::arg("scale"));
  def_misuse<at::Tensor>(m, "fused_op_raw", "input", "bias", "scale");
  m.def("fused_op_backward_raw", &custom_ops::fused_op_backward,
        "fused_op's backward kernel: (grad_input, grad_bias) from the upstream grad and the forward's output.",
        py::arg("grad"), py::arg("output"), py::arg("scale"));
  def_misuse<std::tuple<at::Tensor, at::Tensor>>(m, "fused_op_backward_raw", "grad", "output", "scale");
}
