// Torch glue for chapter 1: op schemas, input checks, version parsing, the CPU/CUDA/Meta
// kernels, autograd, and registration with the dispatcher.
//
// The ops are declared once (TORCH_LIBRARY) and reached from Python as
// torch.ops.cuda_basics.<op>; the CPU, CUDA and Meta implementations are registered side by
// side, and autograd is a torch::autograd::Function registered under the Autograd key, so the
// same .so serves `pip install .` and the JIT route, and opcheck / torch.compile see real ops.
#include "elementwise.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/dispatch.h>
#include <course/index_math.h>
#include <course/versions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <string>
#include <tuple>
#include <vector>

namespace cuda_basics {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::OptVersion;

// The one table of versions the extension dispatches; cuda_basics.VERSIONS is tested against
// it through the `versions` op.
constexpr ::course::NamedVersion<KernelVersion> kVersions[] = {
    {"uncoalesced", KernelVersion::kUncoalesced},
    {"v1", KernelVersion::kV1},
    {"v2", KernelVersion::kV2},
    {"v3", KernelVersion::kV3},
    {"v4", KernelVersion::kV4},
    {"v5", KernelVersion::kV5},
};
constexpr const char* kOps[] = {"vector_add", "saxpy", "relu"};

std::vector<std::string> versions(c10::string_view op) {
  bool known = false;
  for (const char* name : kOps) known = known || ::course::as_std(op) == name;
  TORCH_CHECK(known, "versions: unknown op '", std::string(::course::as_std(op)), "'");
  return ::course::version_names(kVersions);
}

using ::course::to_dtype;

using ::course::check_input;

// Same dtype, device and shape for both inputs; no broadcasting and no type promotion, so
// the kernels can walk two arrays of n elements in lockstep.
void check_pair(const char* op, const char* name_a, const Tensor& a, const char* name_b,
                const Tensor& b) {
  check_input(op, name_a, a);
  check_input(op, name_b, b);
  ::course::check_same_device(op, name_a, a, name_b, b);
  ::course::check_same_dtype(op, name_a, a, name_b, b);
  ::course::check_same_shape(op, name_a, a, name_b, b);
}

// The one path every op and backend takes after its checks. `launch` replaces v5's launch
// shape (tune_vector_add); {0, 0} keeps kV5Launch.
Tensor run_elementwise(const char* op_name, ElementwiseOp op, double alpha, const Tensor& a,
                       const Tensor& b, OptVersion version, VectorLaunch launch = {}) {
  const std::optional<KernelVersion> requested =
      ::course::parse_version(op_name, version, kVersions);
  // Kernels index flat contiguous arrays: a non-contiguous view is copied first (chapter 2
  // teaches kernels that read strides directly). A contiguous view with an offset is not
  // copied, so v3-v5 see the misaligned pointer and must fall back to scalar accesses.
  const Tensor ac = a.contiguous();
  const Tensor bc = b.defined() ? b.contiguous() : Tensor();
  Tensor out = at::empty(ac.sizes(), ac.options());
  if (ac.is_meta() || ac.numel() == 0) return out;  // Meta: shapes only (fake tensors, compile)

  ElementwiseParams p{};
  p.op = op;
  p.dtype = to_dtype(ac.scalar_type());
  p.a = ac.const_data_ptr();
  p.b = bc.defined() ? bc.const_data_ptr() : nullptr;
  p.out = out.mutable_data_ptr();
  p.n = ac.numel();
  p.alpha = alpha;
  p.launch = launch;
  const bool aligned = ::course::is_aligned(p.a, 16) && ::course::is_aligned(p.out, 16) &&
                       (p.b == nullptr || ::course::is_aligned(p.b, 16));
  p.version = requested.value_or(default_version(p.n, static_cast<int>(ac.element_size()), aligned));

  if (ac.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard device_guard(ac.device());
    C10_CUDA_CHECK(launch_elementwise(p, c10::cuda::getCurrentCUDAStream(ac.device().index())));
#else
    ::course::fail_no_cuda_kernels(op_name, "cuda_basics");
#endif
  } else {
    elementwise_cpu(p);
  }
  return out;
}

// Backend kernels (registered for CPU, CUDA and Meta below).
Tensor vector_add_impl(const Tensor& a, const Tensor& b, OptVersion version) {
  check_pair("vector_add", "a", a, "b", b);
  return run_elementwise("vector_add", ElementwiseOp::kAdd, 0.0, a, b, version);
}

Tensor saxpy_impl(double alpha, const Tensor& x, const Tensor& y, OptVersion version) {
  check_pair("saxpy", "x", x, "y", y);
  return run_elementwise("saxpy", ElementwiseOp::kSaxpy, alpha, x, y, version);
}

Tensor relu_impl(const Tensor& x, OptVersion version) {
  check_input("relu", "x", x);
  return run_elementwise("relu", ElementwiseOp::kRelu, 0.0, x, Tensor(), version);
}

// vector_add through v5's kernel in a launch shape of the caller's choosing: what
// tune_cuda_basics.py measures to choose kV5Launch. Not differentiable, CUDA only.
Tensor tune_vector_add_impl(const Tensor& a, const Tensor& b, int64_t threads, int64_t vectors) {
  check_pair("tune_vector_add", "a", a, "b", b);
  TORCH_CHECK(vectors == 1 || vectors == 2 || vectors == 4, "tune_vector_add: vectors must be 1, "
              "2 or 4 (the instantiated kernels), got ", std::to_string(vectors));
  TORCH_CHECK(threads >= 64 && threads <= 1024 && threads % 32 == 0, "tune_vector_add: threads "
              "must be a multiple of 32 in [64, 1024], got ", std::to_string(threads));
  TORCH_CHECK(a.is_cuda() || a.is_meta(), "tune_vector_add: a is on ", a.device(),
              "; launch shapes are a CUDA matter");
  return run_elementwise("tune_vector_add", ElementwiseOp::kAdd, 0.0, a, b, "v5",
                         {static_cast<int>(threads), static_cast<int>(vectors)});
}

// What version=None runs for n elements of `dtype`: the rung, its kernel ("vectorized" for
// v5, "scalar" for v5 on a misaligned view, "per_element" for v1), threads per block, and
// elements each thread moves. Arithmetic on the arguments alone, so any machine can ask.
std::tuple<std::string, std::string, int64_t, int64_t> default_choice(int64_t n,
                                                                      at::ScalarType dtype,
                                                                      bool aligned) {
  TORCH_CHECK(n >= 0, "default_choice: n must be >= 0, got ", std::to_string(n));
  const int64_t elem_bytes = c10::elementSize(dtype);
  const KernelVersion v = default_version(n, static_cast<int>(elem_bytes), aligned);
  const std::string name = ::course::version_name(kVersions, v);
  if (v == KernelVersion::kV1) return {name, "per_element", 256, 1};
  TORCH_CHECK(v == KernelVersion::kV5, "unreachable: default_choice knows v1 and v5 only");
  return {name, aligned ? "vectorized" : "scalar", kV5Launch.threads,
          kV5Launch.vectors * 16 / elem_bytes};
}

// Autograd. Each forward re-enters the dispatcher below the Autograd key, so it reaches the
// CPU/CUDA kernel above; each backward is the op's derivative written with ATen ops.
using ::course::find_op;

class VectorAddFunction : public torch::autograd::Function<VectorAddFunction> {
 public:
  static Tensor forward(AutogradContext*, const Tensor& a, const Tensor& b, OptVersion version) {
    static auto op = find_op<decltype(vector_add_impl)>("cuda_basics::vector_add");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(a, b, version);
  }
  // d(a + b)/da = d(a + b)/db = 1.
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], grads[0], Tensor()};
  }
};

class SaxpyFunction : public torch::autograd::Function<SaxpyFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, double alpha, const Tensor& x, const Tensor& y,
                        OptVersion version) {
    static auto op = find_op<decltype(saxpy_impl)>("cuda_basics::saxpy");
    ctx->saved_data["alpha"] = alpha;
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(alpha, x, y, version);
  }
  // d(alpha x + y)/dx = alpha, d/dy = 1; alpha is a Python float, not differentiable.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double alpha = ctx->saved_data["alpha"].toDouble();
    return {Tensor(), grads[0] * alpha, grads[0], Tensor()};
  }
};

class ReluFunction : public torch::autograd::Function<ReluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, OptVersion version) {
    static auto op = find_op<decltype(relu_impl)>("cuda_basics::relu");
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, version);
  }
  // d relu(x)/dx = 1 where x > 0, else 0 (0 at x == 0), and the incoming gradient where x is
  // NaN: torch.relu's backward, threshold_backward, zeroes exactly the elements with x <= 0, and
  // NaN <= 0 is false. One kernel, where at::where(x > 0, ...) took two and zeroed NaN's.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor x = ctx->get_saved_variables()[0];
    return {at::threshold_backward(grads[0], x, 0), Tensor()};
  }
};

Tensor vector_add_autograd(const Tensor& a, const Tensor& b, OptVersion version) {
  return VectorAddFunction::apply(a, b, version);
}
Tensor saxpy_autograd(double alpha, const Tensor& x, const Tensor& y, OptVersion version) {
  return SaxpyFunction::apply(alpha, x, y, version);
}
Tensor relu_autograd(const Tensor& x, OptVersion version) {
  return ReluFunction::apply(x, version);
}

}  // namespace

TORCH_LIBRARY(cuda_basics, m) {
  m.def("vector_add(Tensor a, Tensor b, str? version=None) -> Tensor");
  m.def("saxpy(float alpha, Tensor x, Tensor y, str? version=None) -> Tensor");
  m.def("relu(Tensor x, str? version=None) -> Tensor");
  m.def("versions(str op) -> str[]", &versions);
  m.def("default_choice(int n, ScalarType dtype, bool aligned) -> (str, str, int, int)",
        &default_choice);
  m.def("tune_vector_add(Tensor a, Tensor b, int threads, int vectors) -> Tensor");
}

// One implementation per op serves CPU, CUDA and Meta: run_elementwise picks the backend from
// the (already checked) device, so the checks cannot drift apart between backends.
static void register_backend_kernels(torch::Library& m) {
  m.impl("vector_add", &vector_add_impl);
  m.impl("saxpy", &saxpy_impl);
  m.impl("relu", &relu_impl);
  m.impl("tune_vector_add", &tune_vector_add_impl);
}
TORCH_LIBRARY_IMPL(cuda_basics, CPU, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(cuda_basics, CUDA, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(cuda_basics, Meta, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(cuda_basics, Autograd, m) {
  m.impl("vector_add", &vector_add_autograd);
  m.impl("saxpy", &saxpy_autograd);
  m.impl("relu", &relu_autograd);
}

}  // namespace cuda_basics
