// Torch glue for chapter 2: op schemas, input checks, version parsing, the CPU/CUDA/Meta
// kernels, autograd, and registration with the dispatcher (the same structure as chapter 1's
// elementwise_ops.cpp: ops declared once, one implementation per op serving every backend).
#include "memory.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/dispatch.h>
#include <course/versions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <string>
#include <vector>

namespace memory_ops {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::OptVersion;

// The tables of versions the extension dispatches; memory_ops.VERSIONS is tested against them
// through the `versions` op.
constexpr ::course::NamedVersion<CopyVersion> kCopyVersions[] = {
    {"v1", CopyVersion::kScalar},
    {"v2", CopyVersion::kVectorized},
};
constexpr ::course::NamedVersion<TransposeVersion> kTransposeVersions[] = {
    {"v1", TransposeVersion::kNaive},
    {"v2", TransposeVersion::kTiled},
    {"v3", TransposeVersion::kTiledPadded},
    {"v4", TransposeVersion::kWideTiles},
    {"v5", TransposeVersion::kWideTilesAnyAlignment},
};
// copy's version=None: v2 at every size (it falls back to v1 by itself on a misaligned view).
// transpose's is default_transpose in memory.h, which looks at strides and alignment.
constexpr CopyVersion kDefaultCopy = CopyVersion::kVectorized;

std::vector<std::string> versions(c10::string_view op) {
  const auto name = ::course::as_std(op);
  if (name == "copy") return ::course::version_names(kCopyVersions);
  if (name == "transpose") return ::course::version_names(kTransposeVersions);
  TORCH_CHECK(false, "versions: unknown op '", std::string(name), "' (ops with a ladder: copy, "
              "transpose)");
}

void check_input(const char* op, const Tensor& x) { ::course::check_input(op, "x", x); }

// Runs `launch` on x's device and current stream, or `cpu` on the CPU. Callers return early
// for Meta tensors (shapes only: fake tensors, torch.compile, opcheck) and empty outputs.
template <typename Params, typename CudaLaunch, typename CpuRun>
void run(const char* op, const Tensor& x, const Params& params, CudaLaunch launch, CpuRun cpu) {
  if (x.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard device_guard(x.device());
    C10_CUDA_CHECK(launch(params, c10::cuda::getCurrentCUDAStream(x.device().index())));
#else
    (void)launch;
    ::course::fail_no_cuda_kernels(op, "memory_ops");
#endif
  } else {
    cpu(params);
  }
}

// The CUDA launchers exist only in a CUDA build; a CPU-only build passes nullptr, never called.
#ifdef WITH_CUDA
#define MEMORY_OPS_LAUNCHER(fn) fn
#else
#define MEMORY_OPS_LAUNCHER(fn) nullptr
#endif

// Backend kernels (registered for CPU, CUDA and Meta below).
Tensor copy_impl(const Tensor& x, OptVersion version) {
  check_input("copy", x);
  const CopyVersion v =
      ::course::parse_version("copy", version, kCopyVersions).value_or(kDefaultCopy);
  // The kernels walk flat contiguous arrays; a strided view is gathered first (transpose is
  // the op that reads strides). An offset view stays as it is: v2 must notice it is misaligned.
  const Tensor src = x.contiguous();
  Tensor out = at::empty_symint(src.sym_sizes(), src.options());
  if (src.is_meta() || out.numel() == 0) return out;
  const CopyParams p{v, static_cast<int>(src.element_size()), src.const_data_ptr(),
                     out.mutable_data_ptr(), src.numel()};
  run("copy", src, p, MEMORY_OPS_LAUNCHER(launch_copy), copy_cpu);
  return out;
}

Tensor strided_copy_impl(const Tensor& x, int64_t stride) {
  check_input("strided_copy", x);
  TORCH_CHECK(stride >= 1, "strided_copy: stride must be >= 1, got ", std::to_string(stride));
  const Tensor src = x.contiguous();
  // As x.flatten()[::stride]. Sizes may be symbolic here (fake tensors under torch.compile):
  // the Meta path returns before anything asks for a concrete number.
  const c10::SymInt n_out = (src.sym_numel() + stride - 1) / stride;
  Tensor out = at::empty_symint({n_out}, src.options());
  if (src.is_meta() || out.numel() == 0) return out;
  const StridedCopyParams p{static_cast<int>(src.element_size()), src.const_data_ptr(),
                            out.mutable_data_ptr(), out.numel(), stride};
  run("strided_copy", src, p, MEMORY_OPS_LAUNCHER(launch_strided_copy), strided_copy_cpu);
  return out;
}

// The kernels' view of x and of the contiguous output at dst: sizes and source strides of the
// last two dims, and of the batch dim when there is one. The caller fills in the version.
TransposeParams transpose_params(const Tensor& x, void* dst) {
  const bool batched = x.dim() == 3;
  return {TransposeVersion::kNaive, static_cast<int>(x.element_size()), x.const_data_ptr(), dst,
          batched ? x.size(0) : 1, x.size(-2), x.size(-1), batched ? x.stride(0) : 0,
          x.stride(-2), x.stride(-1)};
}

Tensor transpose_impl(const Tensor& x, OptVersion version) {
  check_input("transpose", x);
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "transpose: x must be 2-D (rows, cols) or 3-D "
              "(batch, rows, cols), got ", std::to_string(x.dim()), "-D with shape ",
              ::course::shape_str(x.sizes()));
  const std::optional<TransposeVersion> requested =
      ::course::parse_version("transpose", version, kTransposeVersions);
  const bool batched = x.dim() == 3;
  const auto sizes = x.sym_sizes();
  Tensor out = batched ? at::empty_symint({sizes[0], sizes[2], sizes[1]}, x.options())
                       : at::empty_symint({sizes[1], sizes[0]}, x.options());
  if (x.is_meta() || out.numel() == 0) return out;
  // No .contiguous(): the kernels read x through its strides, whatever they are.
  TransposeParams p = transpose_params(x, out.mutable_data_ptr());
  if (requested.has_value()) {
    p.version = *requested;
  } else {
    const TransposeChoice choice = default_transpose(p);
    if (choice.route == TransposeRoute::kCopy) {
      // x's memory already holds the result, in order: copy it (the CPU loop is a copy too).
      const CopyParams c{kDefaultCopy, p.elem_bytes, p.src, p.dst, out.numel()};
      run("transpose", x, c, MEMORY_OPS_LAUNCHER(launch_copy), copy_cpu);
      return out;
    }
    if (choice.route == TransposeRoute::kThin) {
      // One dim short: the thin kernels (the CPU's one loop serves every shape).
      run("transpose", x, p, MEMORY_OPS_LAUNCHER(launch_transpose_thin), transpose_cpu);
      return out;
    }
    p.version = choice.version;
  }
  run("transpose", x, p, MEMORY_OPS_LAUNCHER(launch_transpose), transpose_cpu);
  return out;
}

// What transpose(x, version=None) runs for this x: "copy" (its memory already holds the
// transpose), "thin" (one of the two dims is short: the thin kernels, no rung of the ladder),
// or the rung's name. Decided from sizes, strides and alignment alone, on any device.
std::string default_choice(c10::string_view op, const Tensor& x) {
  const auto name = ::course::as_std(op);
  if (name == "copy") return ::course::version_name(kCopyVersions, kDefaultCopy);
  TORCH_CHECK(name == "transpose", "default_choice: unknown op '", std::string(name),
              "' (ops with a ladder: copy, transpose)");
  check_input("default_choice", x);
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "default_choice: transpose takes 2-D or 3-D x, got ",
              std::to_string(x.dim()), "-D");
  // A fresh output is 256-byte aligned; nullptr stands for it (address 0 is aligned too).
  const TransposeChoice choice = default_transpose(transpose_params(x, nullptr));
  if (choice.route == TransposeRoute::kCopy) return "copy";
  if (choice.route == TransposeRoute::kThin) return "thin";
  return ::course::version_name(kTransposeVersions, choice.version);
}

// Autograd. Each forward re-enters the dispatcher below the Autograd key, so it reaches the
// CPU/CUDA kernel above; each backward is written with the ops themselves or ATen.
using ::course::find_op;

std::optional<std::string> saved_version(OptVersion version) {
  if (!version.has_value()) return std::nullopt;
  return std::string(::course::as_std(*version));
}

class CopyFunction : public torch::autograd::Function<CopyFunction> {
 public:
  static Tensor forward(AutogradContext*, const Tensor& x, OptVersion version) {
    static auto op = find_op<decltype(copy_impl)>("memory_ops::copy");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, version);
  }
  // A copy's Jacobian is the identity.
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], Tensor()};
  }
};

class StridedCopyFunction : public torch::autograd::Function<StridedCopyFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t stride) {
    static auto op = find_op<decltype(strided_copy_impl)>("memory_ops::strided_copy");
    ctx->saved_data["sizes"] = x.sizes();
    ctx->saved_data["stride"] = stride;
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, stride);
  }
  // Each kept element's gradient goes back to where it was read; the skipped ones get zero.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t stride = ctx->saved_data["stride"].toInt();
    Tensor grad_x = at::zeros(sizes, grads[0].options());
    grad_x.view(-1).slice(0, 0, grad_x.numel(), stride).copy_(grads[0]);
    return {grad_x, Tensor()};
  }
};

class TransposeFunction : public torch::autograd::Function<TransposeFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, OptVersion version) {
    static auto op = find_op<decltype(transpose_impl)>("memory_ops::transpose");
    const auto v = saved_version(version);
    ctx->saved_data["version"] = v.has_value() ? c10::IValue(*v) : c10::IValue();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, version);
  }
  // The transpose is a permutation of elements: its backward is the same permutation undone,
  // i.e. another transpose (with the same version, through the dispatcher so that double
  // backward works too).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<Tensor(const Tensor&, OptVersion)>("memory_ops::transpose");
    const auto& saved = ctx->saved_data["version"];
    const std::string v = saved.isNone() ? std::string() : saved.toStringRef();
    const OptVersion version = saved.isNone() ? OptVersion() : OptVersion(c10::string_view(v));
    return {op.call(grads[0], version), Tensor()};
  }
};

Tensor copy_autograd(const Tensor& x, OptVersion version) { return CopyFunction::apply(x, version); }
Tensor strided_copy_autograd(const Tensor& x, int64_t stride) {
  return StridedCopyFunction::apply(x, stride);
}
Tensor transpose_autograd(const Tensor& x, OptVersion version) {
  return TransposeFunction::apply(x, version);
}

}  // namespace

TORCH_LIBRARY(memory_ops, m) {
  m.def("copy(Tensor x, str? version=None) -> Tensor");
  m.def("strided_copy(Tensor x, int stride) -> Tensor");
  m.def("transpose(Tensor x, str? version=None) -> Tensor");
  m.def("versions(str op) -> str[]", &versions);
  m.def("default_choice(str op, Tensor x) -> str", &default_choice);
}

// One implementation per op serves CPU, CUDA and Meta: each picks the backend from the
// (already checked) device, so the checks cannot drift apart between backends.
static void register_backend_kernels(torch::Library& m) {
  m.impl("copy", &copy_impl);
  m.impl("strided_copy", &strided_copy_impl);
  m.impl("transpose", &transpose_impl);
}
TORCH_LIBRARY_IMPL(memory_ops, CPU, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(memory_ops, CUDA, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(memory_ops, Meta, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(memory_ops, Autograd, m) {
  m.impl("copy", &copy_autograd);
  m.impl("strided_copy", &strided_copy_autograd);
  m.impl("transpose", &transpose_autograd);
}

}  // namespace memory_ops
