// Torch glue of the elementwise family: op schemas, input checks, the parsing of the string
// arguments (version, save, activation, approximate), the CPU/CUDA/Meta kernels, autograd, and
// registration into the `fusion` library (whose one TORCH_LIBRARY block is in fusion_ops.cpp).
#include "activation.h"
#include "elementwise.h"
#include "fusion_ops.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/on_cuda.h>
#include <course/dispatch.h>
#include <course/versions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusion {
namespace elementwise {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::NamedVersion;
using ::course::OptVersion;

// The version tables: fusion.VERSIONS is tested against them through the `versions` op.
constexpr NamedVersion<BsrVersion> kBsrVersions[] = {
    {"v1", BsrVersion::kThreeKernels}, {"v2", BsrVersion::kFused}, {"v3", BsrVersion::kVectorized}};
constexpr NamedVersion<BackwardVersion> kBackwardVersions[] = {{"v1", BackwardVersion::kSeparate},
                                                               {"v2", BackwardVersion::kFused}};
constexpr NamedVersion<ActVersion> kActVersions[] = {{"v1", ActVersion::kUnfused}, {"v2", ActVersion::kFused}};
constexpr NamedVersion<LinearVersion> kLinearVersions[] = {{"unfused", LinearVersion::kUnfused},
                                                           {"fused_epilogue", LinearVersion::kFusedEpilogue}};

// The other string arguments, parsed through tables of the same shape.
constexpr NamedVersion<SaveKind> kSaveKinds[] = {
    {"y", SaveKind::kOutput}, {"x", SaveKind::kInput}, {"mask", SaveKind::kMask}};
constexpr NamedVersion<Activation> kActivations[] = {{"relu", Activation::kRelu},
                                                     {"gelu", Activation::kGeluErf},
                                                     {"gelu_tanh", Activation::kGeluTanh},
                                                     {"silu", Activation::kSilu}};
constexpr NamedVersion<Activation> kGeluApproximations[] = {{"none", Activation::kGeluErf},
                                                            {"tanh", Activation::kGeluTanh}};

template <typename V, size_t N>
V parse_choice(const char* op, const char* what, c10::string_view value, const NamedVersion<V> (&table)[N]) {
  std::string list;
  for (const auto& v : table) {
    if (::course::as_std(value) == v.name) return v.version;
    list += (list.empty() ? "" : ", ") + std::string(v.name);
  }
  TORCH_CHECK(false, op, ": unknown ", what, " '", std::string(::course::as_std(value)), "'; expected one of ", list);
}

using ::course::to_dtype;

using ::course::shape_of;

using ::course::check_input;

// x [..., n] and a bias of n elements that broadcasts over its rows.
void check_bias(const char* op, const char* x_name, const Tensor& x, const Tensor& bias) {
  check_input(op, x_name, x);
  check_input(op, "bias", bias);
  ::course::check_same_device(op, x_name, x, "bias", bias);
  ::course::check_same_dtype(op, x_name, x, "bias", bias);
  TORCH_CHECK(x.dim() >= 1, op, ": ", x_name, " is 0-d; it needs a last dim for the bias to run along");
  TORCH_CHECK(bias.dim() == 1 && bias.sym_size(0) == x.sym_size(-1), op, ": bias has shape ", shape_of(bias),
              " but ", x_name, " has shape ", shape_of(x), "; bias must be 1-D with ", x_name,
              ".size(-1) elements");
}

// Rows of a [rows, n] view of t: every dim but the last (1 for a 1-D tensor).
c10::SymInt sym_rows(const Tensor& t) {
  c10::SymInt rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows = rows * t.sym_size(d);
  return rows;
}
int64_t rows_of(const Tensor& t) { return sym_rows(t).expect_int(); }

#define FUSION_ON_CUDA(op, t, ...) COURSE_ON_CUDA(op, "fusion", t, __VA_ARGS__)

#ifdef WITH_CUDA
// Scratch for one launch, asked of the launcher first, freed with the tensor (stream-ordered by
// the caching allocator).
template <typename Query>
void* workspace(Query query, const Tensor& like, Tensor* holder) {
  int64_t bytes = 0;
  C10_CUDA_CHECK(query(&bytes));
  if (bytes == 0) return nullptr;
  *holder = at::empty({bytes}, like.options().dtype(at::kByte));
  return holder->data_ptr();
}
#endif

// ---------------------------------------------------------------------------------------
// fused_bias_scale_relu
// ---------------------------------------------------------------------------------------
constexpr const char* kBsr = "fused_bias_scale_relu";
constexpr const char* kBsrBackward = "fused_bias_scale_relu_backward";

// y, and the mask when `write_mask` (an empty int32 tensor otherwise).
std::tuple<Tensor, Tensor> bsr_forward(const Tensor& x, const Tensor& bias, double scale, c10::string_view save,
                                       OptVersion version, bool write_mask) {
  check_bias(kBsr, "x", x, bias);
  const SaveKind kind = parse_choice(kBsr, "save", save, kSaveKinds);
  const std::optional<BsrVersion> requested = ::course::parse_version(kBsr, version, kBsrVersions);
  write_mask = write_mask && kind == SaveKind::kMask;
  const c10::SymInt n = x.sym_size(-1);
  Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  Tensor mask = write_mask ? at::empty_symint({sym_rows(x), (n + 31) / 32}, x.options().dtype(at::kInt))
                           : at::empty({0}, x.options().dtype(at::kInt));
  if (x.is_meta() || x.numel() == 0) return {y, mask};
  const Tensor xc = x.contiguous();
  const Tensor bc = bias.contiguous();
  const int64_t rows = rows_of(x);
  BiasActParams p{to_dtype(x.scalar_type()), Activation::kRelu, xc.const_data_ptr(), bc.const_data_ptr(), scale,
                  y.mutable_data_ptr(), nullptr,
                  write_mask ? reinterpret_cast<uint32_t*>(mask.mutable_data_ptr<int32_t>()) : nullptr, rows,
                  x.size(-1)};
  if (x.is_cuda()) {
    [[maybe_unused]] const BsrVersion v =
        requested.value_or(default_bsr(rows, p.n, static_cast<int>(x.element_size())));
    FUSION_ON_CUDA(kBsr, x, C10_CUDA_CHECK(launch_bias_scale_relu(p, v, stream)));
  } else {
    bias_act_cpu(p);
  }
  return {y, mask};
}

// Without autograd nothing is kept for a backward: no mask is written, whatever `save` says.
Tensor bsr_impl(const Tensor& x, const Tensor& bias, double scale, c10::string_view save, OptVersion version) {
  return std::get<0>(bsr_forward(x, bias, scale, save, version, false));
}

std::tuple<Tensor, Tensor> bsr_forward_impl(const Tensor& x, const Tensor& bias, double scale,
                                            c10::string_view save, OptVersion version) {
  return bsr_forward(x, bias, scale, save, version, true);
}

// The backward kernels of every op but swiglu: (dx, dbias) from dy and what the forward kept.
std::tuple<Tensor, Tensor> act_backward(const char* op, const Tensor& grad, const Tensor& saved, const Tensor& bias,
                                        double scale, Activation act, SaveKind source,
                                        std::optional<BackwardVersion> version) {
  Tensor dx = at::empty_symint(grad.sym_sizes(), grad.options());
  // No rows: no gradient flows into the bias, which is 0. Otherwise every kernel (and the CPU
  // loop) writes every element of dbias: no zero fill, which was a launch of its own.
  if (grad.is_meta() || grad.numel() == 0) return {dx, at::zeros_symint(bias.sym_sizes(), bias.options())};
  Tensor dbias = at::empty_symint(bias.sym_sizes(), bias.options());
  const Tensor gc = grad.contiguous();
  const Tensor sc = saved.contiguous();
  const Tensor bc = bias.contiguous();
  const int64_t rows = rows_of(grad);
  const bool mask = source == SaveKind::kMask;
  ActBackwardParams p{to_dtype(grad.scalar_type()), act, source, gc.const_data_ptr(),
                      mask ? nullptr : sc.const_data_ptr(),
                      mask ? reinterpret_cast<const uint32_t*>(sc.const_data_ptr<int32_t>()) : nullptr,
                      bc.const_data_ptr(), scale, dx.mutable_data_ptr(), dbias.mutable_data_ptr(), rows,
                      grad.size(-1), nullptr};
  if (grad.is_cuda()) {
    [[maybe_unused]] const BackwardVersion v =
        version.value_or(default_backward(rows, p.n, static_cast<int>(grad.element_size())));
    FUSION_ON_CUDA(op, grad, {
      Tensor scratch;
      p.workspace = workspace([&](int64_t* b) { return act_backward_workspace(p, v, b); }, grad, &scratch);
      C10_CUDA_CHECK(launch_act_backward(p, v, stream));
    });
  } else {
    act_backward_cpu(p);
  }
  return {dx, dbias};
}

std::tuple<Tensor, Tensor> bsr_backward_impl(const Tensor& grad, const Tensor& saved, const Tensor& bias,
                                             double scale, c10::string_view save, OptVersion version) {
  const char* op = kBsrBackward;
  check_bias(op, "grad", grad, bias);
  const SaveKind kind = parse_choice(op, "save", save, kSaveKinds);
  const std::optional<BackwardVersion> requested = ::course::parse_version(op, version, kBackwardVersions);
  TORCH_CHECK(saved.defined(), op, ": saved is an undefined tensor");
  CHECK_SAME_DEVICE(op, grad, saved);
  if (kind == SaveKind::kMask) {
    TORCH_CHECK(saved.scalar_type() == at::kInt, op, ": with save='mask', saved is the int32 mask the forward "
                "wrote, but it has dtype ", saved.scalar_type());
    const bool shape_ok = saved.dim() == 2 && saved.sym_size(0) == sym_rows(grad) &&
                          saved.sym_size(1) == (grad.sym_size(-1) + 31) / 32;
    TORCH_CHECK(shape_ok, op, ": the mask has shape ", shape_of(saved), " but grad of shape ", shape_of(grad),
                " needs [rows, ceil(n / 32)] words");
  } else {
    check_input(op, "saved", saved);
    CHECK_SAME_DTYPE(op, grad, saved);
    TORCH_CHECK(grad.sym_sizes() == saved.sym_sizes(), op, ": grad has shape ", shape_of(grad), " but saved has "
                "shape ", shape_of(saved));
  }
  return act_backward(op, grad, saved, bias, scale, Activation::kRelu, kind, requested);
}

// ---------------------------------------------------------------------------------------
// bias_gelu, bias_silu and the backward they share
// ---------------------------------------------------------------------------------------
Tensor bias_act(const char* op, const Tensor& x, const Tensor& bias, Activation act, OptVersion version) {
  check_bias(op, "x", x, bias);
  const std::optional<ActVersion> requested = ::course::parse_version(op, version, kActVersions);
  Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || x.numel() == 0) return y;
  const Tensor xc = x.contiguous();
  const Tensor bc = bias.contiguous();
  const int64_t rows = rows_of(x);
  const BiasActParams p{to_dtype(x.scalar_type()), act, xc.const_data_ptr(), bc.const_data_ptr(), 1.0,
                        y.mutable_data_ptr(), nullptr, nullptr, rows, x.size(-1)};
  if (x.is_cuda()) {
    [[maybe_unused]] const ActVersion v =
        requested.value_or(default_act(rows, p.n, static_cast<int>(x.element_size())));
    FUSION_ON_CUDA(op, x, C10_CUDA_CHECK(launch_bias_activation(p, v, stream)));
  } else {
    bias_act_cpu(p);
  }
  return y;
}

Tensor bias_gelu_impl(const Tensor& x, const Tensor& bias, c10::string_view approximate, OptVersion version) {
  const Activation act = parse_choice("bias_gelu", "approximate", approximate, kGeluApproximations);
  return bias_act("bias_gelu", x, bias, act, version);
}

Tensor bias_silu_impl(const Tensor& x, const Tensor& bias, OptVersion version) {
  return bias_act("bias_silu", x, bias, Activation::kSilu, version);
}

// (dx, dbias) of y = act(x + bias): dx = dy * act'(x + bias), dbias its column sum.
std::tuple<Tensor, Tensor> bias_activation_backward_impl(const Tensor& grad, const Tensor& x, const Tensor& bias,
                                                         c10::string_view activation) {
  const char* op = "bias_activation_backward";
  check_bias(op, "grad", grad, bias);
  check_input(op, "x", x);
  CHECK_SAME_DEVICE(op, grad, x);
  CHECK_SAME_DTYPE(op, grad, x);
  TORCH_CHECK(grad.sym_sizes() == x.sym_sizes(), op, ": grad has shape ", shape_of(grad), " but x has shape ",
              shape_of(x));
  const Activation act = parse_choice(op, "activation", activation, kActivations);
  return act_backward(op, grad, x, bias, 1.0, act, SaveKind::kInput, std::nullopt);
}

// ---------------------------------------------------------------------------------------
// swiglu
// ---------------------------------------------------------------------------------------
void check_swiglu(const char* op, const Tensor& x) {
  check_input(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x is 0-d; its last dim is split into the two halves a and b");
  const auto n = x.sym_size(-1);
  TORCH_CHECK(n % 2 == 0, op, ": the last dim of x (shape ", shape_of(x), ") is odd; it must split into two "
              "equal halves a and b");
}

std::vector<c10::SymInt> half_sizes(const Tensor& x) {
  std::vector<c10::SymInt> sizes(x.sym_sizes().begin(), x.sym_sizes().end());
  sizes.back() = sizes.back() / 2;
  return sizes;
}

Tensor swiglu_impl(const Tensor& x, OptVersion version) {
  const char* op = "swiglu";
  check_swiglu(op, x);
  const std::optional<ActVersion> requested = ::course::parse_version(op, version, kActVersions);
  Tensor y = at::empty_symint(half_sizes(x), x.options());
  if (x.is_meta() || y.numel() == 0) return y;
  const Tensor xc = x.contiguous();
  const int64_t rows = rows_of(x);
  const SwigluParams p{to_dtype(x.scalar_type()), xc.const_data_ptr(), y.mutable_data_ptr(), rows, x.size(-1) / 2};
  if (x.is_cuda()) {
    [[maybe_unused]] const ActVersion v =
        requested.value_or(default_act(rows, p.half, static_cast<int>(x.element_size())));
    FUSION_ON_CUDA(op, x, C10_CUDA_CHECK(launch_swiglu(p, v, stream)));
  } else {
    swiglu_cpu(p);
  }
  return y;
}

Tensor swiglu_backward_impl(const Tensor& grad, const Tensor& x) {
  const char* op = "swiglu_backward";
  check_swiglu(op, x);
  check_input(op, "grad", grad);
  CHECK_SAME_DEVICE(op, grad, x);
  CHECK_SAME_DTYPE(op, grad, x);
  TORCH_CHECK(grad.sym_sizes() == c10::SymIntArrayRef(half_sizes(x)), op, ": grad has shape ", shape_of(grad),
              " but x of shape ", shape_of(x), " gives outputs of half its last dim");
  Tensor dx = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || grad.numel() == 0) return dx;
  const Tensor gc = grad.contiguous();
  const Tensor xc = x.contiguous();
  const SwigluBackwardParams p{to_dtype(x.scalar_type()), gc.const_data_ptr(), xc.const_data_ptr(),
                               dx.mutable_data_ptr(), rows_of(x), x.size(-1) / 2};
  if (x.is_cuda()) {
    FUSION_ON_CUDA(op, x, C10_CUDA_CHECK(launch_swiglu_backward(p, stream)));
  } else {
    swiglu_backward_cpu(p);
  }
  return dx;
}

// ---------------------------------------------------------------------------------------
// linear_activation
// ---------------------------------------------------------------------------------------
constexpr const char* kLinear = "linear_activation";

void check_linear(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_input(op, "x", x);
  check_input(op, "weight", weight);
  check_input(op, "bias", bias);
  CHECK_SAME_DEVICE(op, x, weight);
  CHECK_SAME_DEVICE(op, x, bias);
  CHECK_SAME_DTYPE(op, x, weight);
  CHECK_SAME_DTYPE(op, x, bias);
  TORCH_CHECK(x.dim() >= 1, op, ": x is 0-d; it needs a last dim of in_features");
  TORCH_CHECK(weight.dim() == 2 && weight.sym_size(1) == x.sym_size(-1), op, ": weight has shape ",
              shape_of(weight), " but x has shape ", shape_of(x), "; weight must be [out_features, x.size(-1)]");
  TORCH_CHECK(bias.dim() == 1 && bias.sym_size(0) == weight.sym_size(0), op, ": bias has shape ", shape_of(bias),
              " but weight has shape ", shape_of(weight), "; bias must be 1-D with weight.size(0) elements");
}

// bias=None, as F.linear allows: zeros of out_features, made once per call, so the epilogue
// keeps one path; the backward's dbias for them is computed and dropped by autograd.
Tensor bias_or_zeros(const std::optional<Tensor>& bias, const Tensor& weight) {
  if (bias.has_value() && bias->defined()) return *bias;
  check_input(kLinear, "weight", weight);
  TORCH_CHECK(weight.dim() == 2, kLinear, ": weight has shape ", shape_of(weight), "; it must be [out_features, in_features]");
  return at::zeros_symint({weight.sym_size(0)}, weight.options());
}

std::vector<c10::SymInt> linear_sizes(const Tensor& x, const Tensor& weight) {
  std::vector<c10::SymInt> sizes(x.sym_sizes().begin(), x.sym_sizes().end());
  sizes.back() = weight.sym_size(0);
  return sizes;
}

// y = act(x @ weight.T + bias), and z = x @ weight.T + bias when `keep_z` (else undefined).
std::tuple<Tensor, Tensor> linear_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                          c10::string_view activation, OptVersion version, bool keep_z) {
  check_linear(kLinear, x, weight, bias);
  const Activation act = parse_choice(kLinear, "activation", activation, kActivations);
  const std::optional<LinearVersion> requested = ::course::parse_version(kLinear, version, kLinearVersions);
  const auto sizes = linear_sizes(x, weight);
  if (x.is_meta()) {
    return {at::empty_symint(sizes, x.options()), keep_z ? at::empty_symint(sizes, x.options()) : Tensor()};
  }
  const int64_t rows = rows_of(x);
  const int64_t n = weight.size(0);
  // cuBLAS (or the CPU BLAS) through ATen; h is a fresh contiguous [rows, n] buffer that the
  // epilogue may overwrite.
  Tensor h = at::mm(x.reshape({rows, x.size(-1)}), weight.t()).contiguous();
  Tensor y = keep_z ? at::empty_like(h) : h;
  if (h.numel() > 0) {
    const Tensor bc = bias.contiguous();
    const BiasActParams p{to_dtype(x.scalar_type()), act, h.const_data_ptr(), bc.const_data_ptr(), 1.0,
                          y.mutable_data_ptr(), keep_z ? h.mutable_data_ptr() : nullptr, nullptr, rows, n};
    if (x.is_cuda()) {
      [[maybe_unused]] const LinearVersion v =
          requested.value_or(default_linear(rows, n, static_cast<int>(x.element_size())));
      FUSION_ON_CUDA(kLinear, x, C10_CUDA_CHECK(launch_linear_epilogue(p, v, stream)));
    } else {
      bias_act_cpu(p);
    }
  }
  return {y.view_symint(sizes), keep_z ? h.view_symint(sizes) : Tensor()};
}

Tensor linear_impl(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, c10::string_view activation,
                   OptVersion version) {
  return std::get<0>(linear_forward(x, weight, bias_or_zeros(bias, weight), activation, version, false));
}

std::tuple<Tensor, Tensor> linear_forward_impl(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                               c10::string_view activation, OptVersion version) {
  return linear_forward(x, weight, bias_or_zeros(bias, weight), activation, version, true);
}

// (dx, dweight, dbias): dz = dy * act'(z) and dbias in one kernel, then two GEMMs.
std::tuple<Tensor, Tensor, Tensor> linear_backward_impl(const Tensor& grad, const Tensor& z, const Tensor& x,
                                                        const Tensor& weight, c10::string_view activation) {
  const char* op = "linear_activation_backward";
  check_input(op, "grad", grad);
  check_input(op, "z", z);
  check_input(op, "x", x);
  check_input(op, "weight", weight);
  CHECK_SAME_DEVICE(op, grad, z);
  CHECK_SAME_DEVICE(op, grad, x);
  CHECK_SAME_DEVICE(op, grad, weight);
  CHECK_SAME_DTYPE(op, grad, z);
  CHECK_SAME_DTYPE(op, grad, x);
  CHECK_SAME_DTYPE(op, grad, weight);
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && weight.sym_size(1) == x.sym_size(-1), op, ": weight has shape ",
              shape_of(weight), " but x has shape ", shape_of(x));
  TORCH_CHECK(grad.sym_sizes() == z.sym_sizes() && grad.sym_sizes() == c10::SymIntArrayRef(linear_sizes(x, weight)),
              op, ": grad has shape ", shape_of(grad), " and z ", shape_of(z), " but x @ weight.T has shape [..., ",
              shape_of(weight), "[0]]");
  const Activation act = parse_choice(op, "activation", activation, kActivations);
  if (grad.is_meta()) {
    return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(weight.sym_sizes(), weight.options()),
            at::empty_symint({weight.sym_size(0)}, weight.options())};
  }
  const int64_t rows = rows_of(x);
  const int64_t n = weight.size(0);
  const Tensor g2 = grad.reshape({rows, n});
  const Tensor z2 = z.reshape({rows, n});
  Tensor dz = at::empty({rows, n}, grad.options());
  Tensor db = at::zeros({n}, grad.options());
  if (dz.numel() > 0) {
    const Tensor gc = g2.contiguous();
    const Tensor zc = z2.contiguous();
    ActBackwardParams p{to_dtype(grad.scalar_type()), act, SaveKind::kInput, gc.const_data_ptr(), zc.const_data_ptr(),
                        nullptr, nullptr, 1.0, dz.mutable_data_ptr(), db.mutable_data_ptr(), rows, n, nullptr};
    if (grad.is_cuda()) {
      FUSION_ON_CUDA(op, grad, {
        Tensor scratch;
        p.workspace = workspace([&](int64_t* b) { return linear_epilogue_backward_workspace(p, b); }, grad, &scratch);
        C10_CUDA_CHECK(launch_linear_epilogue_backward(p, stream));
      });
    } else {
      act_backward_cpu(p);
    }
  } else {
    dz.zero_();
  }
  const Tensor x2 = x.reshape({rows, x.size(-1)});
  return {at::mm(dz, weight).view(x.sizes()), at::mm(dz.t(), x2), db};
}

// ---------------------------------------------------------------------------------------
// version=None: what each op's dispatch picks for x (any device, meta included).
// ---------------------------------------------------------------------------------------
std::string default_choice(c10::string_view op_name, const Tensor& x) {
  const auto name = ::course::as_std(op_name);
  check_input("elementwise_default_choice", "x", x);
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int elem = static_cast<int>(x.element_size());
  if (name == kBsr) return ::course::version_name(kBsrVersions, default_bsr(rows, n, elem));
  if (name == kBsrBackward) return ::course::version_name(kBackwardVersions, default_backward(rows, n, elem));
  if (name == "bias_gelu" || name == "bias_silu") {
    return ::course::version_name(kActVersions, default_act(rows, n, elem));
  }
  if (name == "swiglu") return ::course::version_name(kActVersions, default_act(rows, n / 2, elem));
  TORCH_CHECK(name == kLinear, "elementwise_default_choice: unknown op '", std::string(name), "' (",
              kBsr, ", ", kBsrBackward, ", bias_gelu, bias_silu, swiglu, ", kLinear, ")");
  return ::course::version_name(kLinearVersions, default_linear(rows, n, elem));
}

// The bias gradient's column tiling (course::grad_tiling) for a gradient like x on a GPU of `sms`
// SMs, [tx, ty, column tiles, row tiles, phases, finishes]: the rule the fused backward kernels
// (every bias op's and chapter 5's fused_op's) launch with, asked without a GPU, for freshly allocated
// (16-byte aligned) tensors as the glue's are (course::grad_packs): rows of whole 16-byte vectors
// take them; other rows of at least two vectors take them too (course/bias_act.cuh's span
// kernel, one row in flight a thread), in tiles of a multiple of course::row_phases rows (each
// thread meets one phase); shorter rows, single elements. blocks_per_sm: the launched kernel's
// occupancy, which the grid fills in one wave (the launcher asks the CUDA runtime; 3 for GELU-erf's
// span kernel). finishes: 1 where several row tiles' partial rows are added by the kernel's last
// block of each column tile (course::grad_finishes_in_kernel), 0 where one row tile writes dbias
// or course::column_sum adds the partial rows in a second launch. Rows that start mid-vector: the
// span kernel's tiling, unless COURSE_BIAS_GRAD_ODD=single (course::grad_variant, read from the
// environment as the launcher reads it) sends them to single elements; unset, the launcher picks
// between the two from both kernels' occupancy (bias_grad_odd_rows below), which needs the GPU,
// so the tiling reported is the one launched where the knob names the kernel. A value that names
// no variant is an error here.
std::vector<int64_t> bias_grad_tiling(const Tensor& x, int64_t sms, int64_t blocks_per_sm) {
  check_input("bias_grad_tiling", "x", x);
  TORCH_CHECK(sms >= 1, "bias_grad_tiling: sms must be at least 1, got ", std::to_string(sms));
  TORCH_CHECK(blocks_per_sm >= 1 && blocks_per_sm <= 32, "bias_grad_tiling: blocks_per_sm must be 1 to 32, got ",
              std::to_string(blocks_per_sm));
  const char* finish = std::getenv("COURSE_BIAS_GRAD_FINISH");
  const char* odd = std::getenv("COURSE_BIAS_GRAD_ODD");
  ::course::GradVariant variant;
  TORCH_CHECK(::course::parse_grad_variant(finish, odd, &variant),
              "bias_grad_tiling: COURSE_BIAS_GRAD_FINISH must be batched or serial and COURSE_BIAS_GRAD_ODD auto, "
              "span or single (unset: the defaults), got '",
              finish != nullptr ? finish : "", "' and '", odd != nullptr ? odd : "", "'");
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int elem = static_cast<int>(x.element_size());
  const int vector = 16 / elem;
  const bool phased = n % vector != 0 && n >= 2 * vector && variant.odd != ::course::OddRows::kSingle;
  const int lanes = n % vector == 0 || phased ? vector : 1;
  const int phases = phased ? ::course::row_phases(n, elem) : 1;
  const ::course::GradTiling t =
      ::course::grad_tiling(rows, ::course::ceil_div<int64_t>(n, lanes), lanes * elem,
                            ::course::grad_rows_in_flight(lanes, phased), static_cast<int>(sms), phases,
                            static_cast<int>(blocks_per_sm));
  const bool finishes = ::course::grad_finishes_in_kernel(t.column_tiles, t.row_tiles, t.tx, lanes);
  return {t.tx, t.ty, t.column_tiles, t.row_tiles, phases, finishes ? 1 : 0};
}

// Which kernel the fused backward takes for rows that start mid-vector, "span" or "single"
// (course::odd_rows_take_single), for a backward that reads `save` ("y", "x" or "mask") beside
// dy, given the blocks an SM that the span kernel and the single elements' tile kernel hold (the
// launcher asks the CUDA runtime for both), under COURSE_BIAS_GRAD_ODD as the launcher reads it
// ("span" or "single" force one; unset or "auto", the rule).
std::string bias_grad_odd_rows(c10::string_view save, int64_t span_blocks_per_sm, int64_t single_blocks_per_sm) {
  const SaveKind source = parse_choice("bias_grad_odd_rows", "save", save, kSaveKinds);
  TORCH_CHECK(span_blocks_per_sm >= 1 && span_blocks_per_sm <= 32 && single_blocks_per_sm >= 1 &&
                  single_blocks_per_sm <= 32,
              "bias_grad_odd_rows: blocks an SM must be 1 to 32, got ", std::to_string(span_blocks_per_sm), " and ",
              std::to_string(single_blocks_per_sm));
  const char* odd = std::getenv("COURSE_BIAS_GRAD_ODD");
  ::course::GradVariant variant;
  TORCH_CHECK(::course::parse_grad_variant(nullptr, odd, &variant),
              "bias_grad_odd_rows: COURSE_BIAS_GRAD_ODD must be auto, span or single (unset: auto), got '",
              odd != nullptr ? odd : "", "'");
  const bool single = ::course::odd_rows_take_single(source, static_cast<int>(span_blocks_per_sm),
                                                     static_cast<int>(single_blocks_per_sm), variant.odd);
  return single ? "single" : "span";
}

// The fused forward's kernel (course::launch_bias_act) for a bias op on x without a mask, on a
// GPU of `sms` SMs, for freshly allocated (16-byte aligned) tensors as the glue's are: "tiles"
// where the activation keeps several rows in flight a thread (GELU-erf), the rows are whole
// vectors that fill every tile, and the tiles' grid fills a wave; "flat" otherwise. One rule,
// course::forward_kernel, which the launcher takes too.
std::string bias_forward_kernel(const Tensor& x, c10::string_view activation, int64_t sms) {
  check_input("bias_forward_kernel", "x", x);
  TORCH_CHECK(sms >= 1, "bias_forward_kernel: sms must be at least 1, got ", std::to_string(sms));
  const Activation act = parse_choice("bias_forward_kernel", "activation", activation, kActivations);
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const ::course::ForwardKernel kernel =
      ::course::forward_kernel(rows, n, static_cast<int>(x.element_size()), /*aligned=*/true, /*flat_pairs=*/true,
                               1, forward_rows(act), static_cast<int>(sms), forward_min_blocks(act));
  return kernel == ::course::ForwardKernel::kTiles ? "tiles" : "flat";
}

// The flat forward's form (course::flat_uniform, bias_act.h) for x on a GPU of `sms` SMs, as the
// launchers take it for freshly allocated outputs and bias: "vectors" where every row is whole
// 16-byte vectors from x's start (nothing for the form to change), else "uniform" (a grid of one
// wave or less, or COURSE_FORWARD_ODD=uniform) or "branch". x is a bias op's input ([rows, n]) or,
// swiglu true, swiglu's ([rows, 2 half]: y's vectors are the walk). x's alignment is its data
// pointer's, or for a meta tensor its storage offset's.
std::string flat_forward_form(const Tensor& x, int64_t sms, bool swiglu) {
  check_input("flat_forward_form", "x", x);
  TORCH_CHECK(sms >= 1, "flat_forward_form: sms must be at least 1, got ", std::to_string(sms));
  ::course::FlatOdd variant;
  const char* value = std::getenv("COURSE_FORWARD_ODD");
  TORCH_CHECK(::course::parse_flat_odd(value, &variant), "flat_forward_form: COURSE_FORWARD_ODD must be auto, branch or ",
              "uniform (or unset), got '", value == nullptr ? "" : value, "'");
  const int elem = static_cast<int>(x.element_size());
  const int64_t lanes = 16 / elem;
  const int64_t width = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t n = swiglu ? width / 2 : width;
  const int64_t rows = width == 0 ? 0 : x.numel() / width;
  const bool aligned = x.is_meta() ? x.storage_offset() * elem % 16 == 0 : ::course::is_aligned(x.const_data_ptr(), 16);
  if (n % lanes == 0 && aligned) return "vectors";
  // The walk's vectors: y's (fresh, from its start) for swiglu, x's from its first boundary for a bias op.
  const int64_t head = swiglu || aligned ? 0 : (16 - x.storage_offset() * elem % 16) / elem;
  const int64_t total = rows * n;
  const int64_t vectors = total > head ? (total - head) / lanes : 0;
  const bool uniform = ::course::flat_uniform(::course::ceil_div<int64_t>(vectors, 256), static_cast<int>(sms), variant);
  return uniform ? "uniform" : "branch";
}

// The flat forward's column arithmetic (course::FastDivmod, index_math.h: the row length's magic
// number, worked out on the host, a multiply-high, an add and a shift in the kernel), asked on the
// CPU: [i / n, i % n] for each index of `index` (int64, each 0 to 2^32 - 1) by row length n (1 to
// 2^32 - 1), as the kernel computes them (the host form of its multiply-high).
Tensor flat_column_divmod(const Tensor& index, int64_t n) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.device().is_cpu(),
              "flat_column_divmod: index must be an int64 CPU tensor, got ", index.scalar_type(), " on ", index.device());
  TORCH_CHECK(n >= 1 && n <= UINT32_MAX, "flat_column_divmod: n must be 1 to 2^32 - 1, got ", std::to_string(n));
  const Tensor in = index.contiguous();
  const int64_t* i = in.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < in.numel(); ++k) {
    TORCH_CHECK(i[k] >= 0 && i[k] <= UINT32_MAX, "flat_column_divmod: indices must be 0 to 2^32 - 1, got ",
                std::to_string(i[k]));
  }
  const ::course::FastDivmod n_div(static_cast<uint32_t>(n));
  Tensor out = at::empty({in.numel(), 2}, in.options());
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t k = 0; k < in.numel(); ++k) {
    o[2 * k] = n_div.div(static_cast<uint32_t>(i[k]));
    o[2 * k + 1] = n_div.mod(static_cast<uint32_t>(i[k]));
  }
  return out;
}

// swiglu's launch for x on a GPU of `sms` SMs, [kernel, threads per block, blocks, whole vectors]:
// the rule v2's forward (backward false) or the backward launches with, asked without a GPU, for
// a freshly allocated (16-byte aligned) y, dy and dx as the glue's are. kernel 0: the flat walk,
// with swiglu_grid's grid; 1: the backward's column tiles of single elements (rows of x off
// 16-byte boundaries, swiglu_backward_kernel), the rest 0. x's alignment is its data pointer's,
// or for a meta tensor its storage offset's (an allocation starts on a boundary).
std::vector<int64_t> swiglu_grid_of(const Tensor& x, int64_t sms, bool backward) {
  check_swiglu("swiglu_grid", x);
  TORCH_CHECK(sms >= 1, "swiglu_grid: sms must be at least 1, got ", std::to_string(sms));
  const int64_t half = x.size(-1) / 2;
  const int64_t rows = half == 0 ? 0 : x.numel() / x.size(-1);
  const int elem = static_cast<int>(x.element_size());
  // A strided x is copied first (swiglu_backward_impl's contiguous()), into a fresh allocation.
  const bool x_aligned = !x.is_contiguous() || (x.is_meta() ? x.storage_offset() * elem % 16 == 0
                                                             : ::course::is_aligned(x.const_data_ptr(), 16));
  if (backward && swiglu_backward_kernel(half, elem, x_aligned) == SwigluBackwardKernel::kTiles) {
    return {1, 0, 0, 0};  // the tiles' grid is course/bias_act.cuh's make_tiling, device code
  }
  const SwigluGrid g = swiglu_grid(rows, half, elem, 0, static_cast<int>(sms));
  return {0, g.threads, g.blocks, g.vectors};
}

// ---------------------------------------------------------------------------------------
// Autograd. Each forward re-enters the dispatcher below the Autograd key (reaching the kernels
// above); each backward is the family's own backward op. First derivatives only: the backward
// ops have no derivative of their own (double backward raises).
// ---------------------------------------------------------------------------------------
using ::course::find_op;

std::string as_string(c10::string_view s) { return std::string(::course::as_std(s)); }

class BsrFunction : public torch::autograd::Function<BsrFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, double scale,
                        c10::string_view save, OptVersion version) {
    static auto op = find_op<decltype(bsr_forward_impl)>("fusion::fused_bias_scale_relu_forward");
    Tensor y;
    Tensor mask;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mask) = op.call(x, bias, scale, save, version);
    }
    const SaveKind kind = parse_choice(kBsr, "save", save, kSaveKinds);
    ctx->save_for_backward({kind == SaveKind::kOutput ? y : (kind == SaveKind::kInput ? x : mask), bias});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["save"] = as_string(save);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(bsr_backward_impl)>("fusion::fused_bias_scale_relu_backward");
    const auto saved = ctx->get_saved_variables();
    const std::string save = ctx->saved_data["save"].toStringRef();
    auto [dx, dbias] = op.call(grads[0].contiguous(), saved[0], saved[1], ctx->saved_data["scale"].toDouble(), save,
                               std::nullopt);
    return {dx, dbias, Tensor(), Tensor(), Tensor()};
  }
};

class BiasActFunction : public torch::autograd::Function<BiasActFunction> {
 public:
  // activation: "gelu", "gelu_tanh" or "silu" (the names bias_activation_backward takes).
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const std::string& activation,
                        OptVersion version) {
    static auto gelu = find_op<decltype(bias_gelu_impl)>("fusion::bias_gelu");
    static auto silu = find_op<decltype(bias_silu_impl)>("fusion::bias_silu");
    ctx->save_for_backward({x, bias});
    ctx->saved_data["activation"] = activation;
    at::AutoDispatchBelowADInplaceOrView guard;
    if (activation == "silu") return silu.call(x, bias, version);
    return gelu.call(x, bias, activation == "gelu" ? "none" : "tanh", version);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(bias_activation_backward_impl)>("fusion::bias_activation_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dbias] = op.call(grads[0].contiguous(), saved[0], saved[1], ctx->saved_data["activation"].toStringRef());
    return {dx, dbias, Tensor(), Tensor()};
  }
};

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, OptVersion version) {
    static auto op = find_op<decltype(swiglu_impl)>("fusion::swiglu");
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, version);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(swiglu_backward_impl)>("fusion::swiglu_backward");
    return {op.call(grads[0].contiguous(), ctx->get_saved_variables()[0]), Tensor()};
  }
};

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                        c10::string_view activation, OptVersion version) {
    static auto op = find_op<decltype(linear_forward_impl)>("fusion::linear_activation_forward");
    Tensor y;
    Tensor z;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, z) = op.call(x, weight, bias, activation, version);
    }
    ctx->save_for_backward({z, x, weight});
    ctx->saved_data["activation"] = as_string(activation);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(linear_backward_impl)>("fusion::linear_activation_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw, db] = op.call(grads[0].contiguous(), saved[0], saved[1], saved[2],
                                ctx->saved_data["activation"].toStringRef());
    return {dx, dw, db, Tensor(), Tensor()};
  }
};

Tensor bsr_autograd(const Tensor& x, const Tensor& bias, double scale, c10::string_view save, OptVersion version) {
  // No input needs a gradient (or grad mode is off): nothing is kept for a backward, so no mask
  // is written (a sixteenth more bytes in 2-byte dtypes, and rows that are not whole 32-bit words
  // of mask would leave the flat kernel for the tiles' single elements), and no graph node.
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || bias.requires_grad())) {
    static auto op = find_op<decltype(bsr_impl)>("fusion::fused_bias_scale_relu");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, bias, scale, save, version);
  }
  return BsrFunction::apply(x, bias, scale, save, version);
}
Tensor bias_gelu_autograd(const Tensor& x, const Tensor& bias, c10::string_view approximate, OptVersion version) {
  const Activation act = parse_choice("bias_gelu", "approximate", approximate, kGeluApproximations);
  return BiasActFunction::apply(x, bias, std::string(act == Activation::kGeluErf ? "gelu" : "gelu_tanh"), version);
}
Tensor bias_silu_autograd(const Tensor& x, const Tensor& bias, OptVersion version) {
  return BiasActFunction::apply(x, bias, std::string("silu"), version);
}
Tensor swiglu_autograd(const Tensor& x, OptVersion version) { return SwigluFunction::apply(x, version); }
Tensor linear_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias_or,
                       c10::string_view activation, OptVersion version) {
  const Tensor bias = bias_or_zeros(bias_or, weight);
  // Inference (no input needs a gradient, or grad mode is off): no graph node, no saved z and
  // no second M x N buffer. The Function's bookkeeping was most of the op's host time, which a
  // GEMM of a few rows does not hide (chapter 5 measures per-call overhead).
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (x.requires_grad() || weight.requires_grad() || bias.requires_grad());
  if (!needs_grad) {
    static auto op = find_op<decltype(linear_impl)>("fusion::linear_activation");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, weight, bias, activation, version);
  }
  return LinearFunction::apply(x, weight, bias, activation, version);
}

}  // namespace

}  // namespace elementwise

std::optional<std::vector<std::string>> elementwise_versions(std::string_view op) {
  using namespace elementwise;
  if (op == kBsr) return ::course::version_names(kBsrVersions);
  if (op == kBsrBackward) return ::course::version_names(kBackwardVersions);
  if (op == "bias_gelu" || op == "bias_silu" || op == "swiglu") return ::course::version_names(kActVersions);
  if (op == kLinear) return ::course::version_names(kLinearVersions);
  return std::nullopt;
}

}  // namespace fusion

TORCH_LIBRARY_FRAGMENT(fusion, m) {
  m.def("fused_bias_scale_relu(Tensor x, Tensor bias, float scale, *, str save=\"mask\", str? version=None) -> Tensor");
  m.def("fused_bias_scale_relu_forward(Tensor x, Tensor bias, float scale, str save, str? version=None) "
        "-> (Tensor, Tensor)");
  m.def("fused_bias_scale_relu_backward(Tensor grad, Tensor saved, Tensor bias, float scale, str save=\"mask\", "
        "str? version=None) -> (Tensor, Tensor)");
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate=\"none\", *, str? version=None) -> Tensor");
  m.def("bias_silu(Tensor x, Tensor bias, *, str? version=None) -> Tensor");
  m.def("bias_activation_backward(Tensor grad, Tensor x, Tensor bias, str activation) -> (Tensor, Tensor)");
  m.def("swiglu(Tensor x, *, str? version=None) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("linear_activation(Tensor x, Tensor weight, Tensor? bias, str activation, *, str? version=None) -> Tensor");
  m.def("linear_activation_forward(Tensor x, Tensor weight, Tensor? bias, str activation, str? version=None) "
        "-> (Tensor, Tensor)");
  m.def("linear_activation_backward(Tensor grad, Tensor z, Tensor x, Tensor weight, str activation) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("elementwise_default_choice(str op, Tensor x) -> str", &fusion::elementwise::default_choice);
  m.def("bias_grad_tiling(Tensor x, int sms, int blocks_per_sm=4) -> int[]", &fusion::elementwise::bias_grad_tiling);
  m.def("bias_grad_odd_rows(str save, int span_blocks_per_sm, int single_blocks_per_sm) -> str",
        &fusion::elementwise::bias_grad_odd_rows);
  m.def("swiglu_grid(Tensor x, int sms, bool backward=False) -> int[]", &fusion::elementwise::swiglu_grid_of);
  m.def("bias_forward_kernel(Tensor x, str activation, int sms) -> str", &fusion::elementwise::bias_forward_kernel);
  m.def("flat_forward_form(Tensor x, int sms, bool swiglu=False) -> str", &fusion::elementwise::flat_forward_form);
  m.def("flat_column_divmod(Tensor index, int n) -> Tensor", &fusion::elementwise::flat_column_divmod);
}

// One implementation per op serves CPU, CUDA and Meta: each picks the backend from the (already
// checked) device, so the checks cannot drift apart between backends.
namespace {
void register_backend_kernels(torch::Library& m) {
  using namespace fusion::elementwise;
  m.impl("fused_bias_scale_relu", &bsr_impl);
  m.impl("fused_bias_scale_relu_forward", &bsr_forward_impl);
  m.impl("fused_bias_scale_relu_backward", &bsr_backward_impl);
  m.impl("bias_gelu", &bias_gelu_impl);
  m.impl("bias_silu", &bias_silu_impl);
  m.impl("bias_activation_backward", &bias_activation_backward_impl);
  m.impl("swiglu", &swiglu_impl);
  m.impl("swiglu_backward", &swiglu_backward_impl);
  m.impl("linear_activation", &linear_impl);
  m.impl("linear_activation_forward", &linear_forward_impl);
  m.impl("linear_activation_backward", &linear_backward_impl);
}
}  // namespace

TORCH_LIBRARY_IMPL(fusion, CPU, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, CUDA, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, Meta, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, Autograd, m) {
  using namespace fusion::elementwise;
  m.impl("fused_bias_scale_relu", &bsr_autograd);
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("bias_silu", &bias_silu_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("linear_activation", &linear_autograd);
}
