// Torch glue for the norms: op schemas (a fragment of the `fusion` library, whose one
// TORCH_LIBRARY block is in fusion_ops.cpp), input checks, version parsing, the CPU/CUDA/Meta
// kernels, the autograd Functions, and registration with the dispatcher. One implementation per
// op serves every backend: it picks the backend from the (already checked) device, so the
// checks cannot drift apart between backends.
#include "fusion_ops.h"
#include "norm.h"

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

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusion {
namespace norm {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::OptVersion;

// The tables of versions the extension dispatches; fusion.VERSIONS is tested against them
// through the `versions` op.
constexpr ::course::NamedVersion<NormVersion> kNormVersions[] = {
    {"v1", NormVersion::kTwoPass}, {"v2", NormVersion::kWelford}, {"v3", NormVersion::kResident}};
constexpr ::course::NamedVersion<NormBackwardVersion> kBackwardVersions[] = {
    {"v1", NormBackwardVersion::kStreamed}, {"v2", NormBackwardVersion::kResident}};
constexpr ::course::NamedVersion<AddNormVersion> kAddVersions[] = {
    {"v1", AddNormVersion::kUnfused}, {"v2", AddNormVersion::kFused}};

using ::course::to_dtype;

// mean and rstd are kept in the accumulation type: float32, float64 for float64 inputs.
at::ScalarType stat_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

using ::course::check_input;

// x: at least 1-D, normalized over its last dim. A parameter (weight, bias): 1-D of that size,
// x's dtype and device.
void check_x(const char* op, const Tensor& x) {
  check_input(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x is a 0-d tensor; it needs at least one dim (the normalized one)");
}

void check_param(const char* op, const char* name, const Tensor& p, const Tensor& x) {
  TORCH_CHECK(p.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_device_supported(op, name, p);
  ::course::check_same_device(op, name, p, "x", x);
  ::course::check_same_dtype(op, name, p, "x", x);
  TORCH_CHECK(p.dim() == 1 && p.sym_size(0) == x.sym_size(-1), op, ": ", name, " has shape ",
              ::course::shape_str(p.sizes()), " but x's last dim (the normalized one) has size ",
              std::to_string(x.size(-1)), " (expected ", name, " of shape [", std::to_string(x.size(-1)), "])");
}

// weight and bias may be None, as in F.layer_norm and F.rms_norm: a missing weight is ones, a
// missing bias zeros, made here once per call (n elements beside x's rows x n), so the kernels
// keep one path. Their gradients are computed with the rest and dropped by autograd, as
// gradients of tensors that require none are.
Tensor param_or(const char* op, const char* name, const OptTensor& p, const Tensor& x, double fill) {
  if (p.has_value() && p->defined()) {
    check_param(op, name, *p, x);
    return *p;
  }
  return fill == 0.0 ? at::zeros_symint({x.sym_size(-1)}, x.options()) : at::ones_symint({x.sym_size(-1)}, x.options());
}

// eps must be >= 0 (0 is allowed, as in torch; a row of equal values then divides by zero and
// gives inf/NaN, as torch's does). A negative eps could make var + eps negative: rejected.
void check_eps(const char* op, double eps) {
  // std::to_string, not a streamed double: see course::shape_str on ostream's number formatting.
  TORCH_CHECK(eps >= 0.0 && !std::isnan(eps), op, ": eps must be >= 0, got ", std::to_string(eps));
}

// The statistics' shape: x's without its last dim.
std::vector<c10::SymInt> stat_sizes(const Tensor& x) {
  auto sizes = x.sym_sizes().vec();
  sizes.pop_back();
  return sizes;
}

// The CUDA entry points exist only in a CUDA build.
#ifdef WITH_CUDA
void launch_cuda(const char*, const Tensor& x, const NormParams& p) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  C10_CUDA_CHECK(launch_norm(p, c10::cuda::getCurrentCUDAStream(x.device().index())));
}
void launch_cuda_add(const char*, const Tensor& x, const AddParams& p) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  C10_CUDA_CHECK(launch_add(p, c10::cuda::getCurrentCUDAStream(x.device().index())));
}
void launch_cuda_backward(const char*, const Tensor& x, NormBackwardParams p) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  int64_t bytes = 0;
  C10_CUDA_CHECK(norm_backward_workspace(p, &bytes));
  const Tensor workspace = at::empty({bytes}, x.options().dtype(at::kByte));
  p.workspace = workspace.mutable_data_ptr();
  C10_CUDA_CHECK(launch_norm_backward(p, c10::cuda::getCurrentCUDAStream(x.device().index())));
}
#else
void launch_cuda(const char* op, const Tensor&, const NormParams&) { ::course::fail_no_cuda_kernels(op, "fusion"); }
void launch_cuda_add(const char* op, const Tensor&, const AddParams&) { ::course::fail_no_cuda_kernels(op, "fusion"); }
void launch_cuda_backward(const char* op, const Tensor&, const NormBackwardParams&) {
  ::course::fail_no_cuda_kernels(op, "fusion");
}
#endif

void run(const char* op, const Tensor& x, const NormParams& p) {
  if (x.is_cuda()) {
    launch_cuda(op, x, p);
  } else {
    norm_cpu(p);
  }
}

// ---------------------------------------------------------------------------------------
// Forward: (y, mean, rstd) for LayerNorm, (y, rstd) for RMSNorm, (y, x + residual, rstd) for
// fused_add_rms_norm. mean and rstd have x's shape without its last dim.
// ---------------------------------------------------------------------------------------
struct Forward {
  Tensor y, mean, rstd, sum;
};

Forward norm_forward(const char* op, NormKind kind, const Tensor& x, const Tensor* residual, const Tensor& weight,
                     const Tensor* bias, double eps, NormVersion version) {
  Forward f;
  const auto stat_options = x.options().dtype(stat_dtype(x.scalar_type()));
  f.y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (residual != nullptr) f.sum = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (kind == NormKind::kLayerNorm) f.mean = at::empty_symint(stat_sizes(x), stat_options);
  f.rstd = at::empty_symint(stat_sizes(x), stat_options);
  if (x.is_meta() || x.numel() == 0) {
    // rows of nothing: their statistics are undefined, as torch's (0 / 0)
    if (!x.is_meta() && f.rstd.numel() > 0) {
      f.rstd.fill_(std::numeric_limits<double>::quiet_NaN());
      if (f.mean.defined()) f.mean.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    return f;
  }
  const Tensor xc = x.contiguous();
  const Tensor rc = residual != nullptr ? residual->contiguous() : Tensor();
  const Tensor wc = weight.contiguous();
  const Tensor bc = bias != nullptr ? bias->contiguous() : Tensor();
  const int64_t n = x.size(-1);
  NormParams p{kind,
               version,
               to_dtype(x.scalar_type()),
               xc.const_data_ptr(),
               rc.defined() ? rc.const_data_ptr() : nullptr,
               f.sum.defined() ? f.sum.mutable_data_ptr() : nullptr,
               wc.const_data_ptr(),
               bc.defined() ? bc.const_data_ptr() : nullptr,
               f.y.mutable_data_ptr(),
               f.mean.defined() ? f.mean.mutable_data_ptr() : nullptr,
               f.rstd.mutable_data_ptr(),
               xc.numel() / n,
               n,
               eps};
  run(op, xc, p);
  return f;
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_forward_impl(const Tensor& x, const OptTensor& weight_or,
                                                           const OptTensor& bias_or, double eps, OptVersion version) {
  const char* op = "layer_norm";
  check_x(op, x);
  const Tensor weight = param_or(op, "weight", weight_or, x, 1.0);
  const Tensor bias = param_or(op, "bias", bias_or, x, 0.0);
  check_eps(op, eps);
  const NormVersion v = ::course::parse_version(op, version, kNormVersions).value_or(default_norm());
  Forward f = norm_forward(op, NormKind::kLayerNorm, x, nullptr, weight, &bias, eps, v);
  return {f.y, f.mean, f.rstd};
}

std::tuple<Tensor, Tensor> rms_norm_forward_impl(const Tensor& x, const OptTensor& weight_or, double eps,
                                                 OptVersion version) {
  const char* op = "rms_norm";
  check_x(op, x);
  const Tensor weight = param_or(op, "weight", weight_or, x, 1.0);
  check_eps(op, eps);
  const NormVersion v = ::course::parse_version(op, version, kNormVersions).value_or(default_norm());
  Forward f = norm_forward(op, NormKind::kRmsNorm, x, nullptr, weight, nullptr, eps, v);
  return {f.y, f.rstd};
}

std::tuple<Tensor, Tensor, Tensor> fused_add_rms_norm_forward_impl(const Tensor& x, const Tensor& residual,
                                                                   const OptTensor& weight_or, double eps,
                                                                   OptVersion version) {
  const char* op = "fused_add_rms_norm";
  check_x(op, x);
  check_input(op, "residual", residual);
  CHECK_SAME_DEVICE(op, residual, x);
  CHECK_SAME_DTYPE(op, residual, x);
  TORCH_CHECK(residual.sym_sizes() == x.sym_sizes(), op, ": residual has shape ",
              ::course::shape_str(residual.sizes()), " but x has shape ", ::course::shape_str(x.sizes()),
              " (shapes must match; no broadcasting)");
  const Tensor weight = param_or(op, "weight", weight_or, x, 1.0);
  check_eps(op, eps);
  const AddNormVersion v = ::course::parse_version(op, version, kAddVersions).value_or(default_add_norm());
  if (v == AddNormVersion::kFused) {
    Forward f = norm_forward(op, NormKind::kRmsNorm, x, &residual, weight, nullptr, eps, NormVersion::kResident);
    return {f.y, f.sum, f.rstd};
  }
  // v1: the sum is written by its own kernel, then normalized by rms_norm's default rung.
  Tensor sum = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (!x.is_meta() && x.numel() > 0) {
    const Tensor xc = x.contiguous();
    const Tensor rc = residual.contiguous();
    const AddParams p{to_dtype(x.scalar_type()), xc.const_data_ptr(), rc.const_data_ptr(), sum.mutable_data_ptr(),
                      xc.numel()};
    if (x.is_cuda()) {
      launch_cuda_add(op, x, p);
    } else {
      sum.copy_((xc.to(stat_dtype(x.scalar_type())) + rc.to(stat_dtype(x.scalar_type()))).to(x.scalar_type()));
    }
  }
  Forward f = norm_forward(op, NormKind::kRmsNorm, sum, nullptr, weight, nullptr, eps, default_norm());
  return {f.y, sum, f.rstd};
}

Tensor layer_norm_impl(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps, OptVersion version) {
  return std::get<0>(layer_norm_forward_impl(x, weight, bias, eps, version));
}
Tensor rms_norm_impl(const Tensor& x, const OptTensor& weight, double eps, OptVersion version) {
  return std::get<0>(rms_norm_forward_impl(x, weight, eps, version));
}
std::tuple<Tensor, Tensor> fused_add_rms_norm_impl(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                                   double eps, OptVersion version) {
  auto out = fused_add_rms_norm_forward_impl(x, residual, weight, eps, version);
  return {std::get<0>(out), std::get<1>(out)};
}

// ---------------------------------------------------------------------------------------
// Backward: (dx, dweight, dbias) for LayerNorm, (dx, dweight) for RMSNorm, from the saved
// statistics.
// ---------------------------------------------------------------------------------------
void check_stat(const char* op, const char* name, const Tensor& s, const Tensor& x) {
  TORCH_CHECK(s.defined(), op, ": ", name, " is an undefined tensor");
  ::course::check_same_device(op, name, s, "x", x);
  TORCH_CHECK(s.scalar_type() == stat_dtype(x.scalar_type()), op, ": ", name, " has dtype ", s.scalar_type(),
              " but must be ", stat_dtype(x.scalar_type()), " for x of dtype ", x.scalar_type(),
              " (what the forward returns)");
  TORCH_CHECK(s.sym_numel() * x.sym_size(-1) == x.sym_numel() || x.sym_size(-1) == 0, op, ": ", name, " has ",
              std::to_string(s.numel()), " elements but x has ", std::to_string(x.numel() / std::max<int64_t>(x.size(-1), 1)),
              " rows");
}

std::tuple<Tensor, Tensor, Tensor> norm_backward(const char* op, NormKind kind, const Tensor& dy, const Tensor& x,
                                                 const OptTensor& weight_or, const Tensor* mean, const Tensor& rstd,
                                                 OptVersion version, const OptTensor& dsum_or = std::nullopt) {
  check_x(op, x);
  check_input(op, "dy", dy);
  CHECK_SAME_DEVICE(op, dy, x);
  CHECK_SAME_DTYPE(op, dy, x);
  TORCH_CHECK(dy.sym_sizes() == x.sym_sizes(), op, ": dy has shape ", ::course::shape_str(dy.sizes()),
              " but x has shape ", ::course::shape_str(x.sizes()));
  const Tensor weight = param_or(op, "weight", weight_or, x, 1.0);
  if (mean != nullptr) check_stat(op, "mean", *mean, x);
  check_stat(op, "rstd", rstd, x);
  const bool has_dsum = dsum_or.has_value() && dsum_or->defined();
  if (has_dsum) {
    const Tensor& dsum = *dsum_or;
    check_input(op, "dsum", dsum);
    CHECK_SAME_DEVICE(op, dsum, x);
    CHECK_SAME_DTYPE(op, dsum, x);
    TORCH_CHECK(dsum.sym_sizes() == x.sym_sizes(), op, ": dsum has shape ", ::course::shape_str(dsum.sizes()),
                " but x has shape ", ::course::shape_str(x.sizes()), " (it is added to dx)");
  }
  const NormBackwardVersion v =
      ::course::parse_version(op, version, kBackwardVersions).value_or(default_norm_backward());
  const bool centered = kind == NormKind::kLayerNorm;
  Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  Tensor dweight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  Tensor dbias = centered ? at::empty_like(weight, at::MemoryFormat::Contiguous) : Tensor();
  if (x.is_meta()) return {dx, dweight, dbias};
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  if (rows == 0 || n == 0) {  // no rows: the column sums are empty sums (dx is empty too)
    dweight.zero_();
    if (centered) dbias.zero_();
    return {dx, dweight, dbias};
  }
  const Tensor dyc = dy.contiguous();
  const Tensor xc = x.contiguous();
  const Tensor wc = weight.contiguous();
  const Tensor mc = mean != nullptr ? mean->contiguous() : Tensor();
  const Tensor rc = rstd.contiguous();
  const Tensor sc = has_dsum ? dsum_or->contiguous() : Tensor();
  NormBackwardParams p{kind,
                       v,
                       to_dtype(x.scalar_type()),
                       dyc.const_data_ptr(),
                       xc.const_data_ptr(),
                       wc.const_data_ptr(),
                       mc.defined() ? mc.const_data_ptr() : nullptr,
                       rc.const_data_ptr(),
                       dx.mutable_data_ptr(),
                       dweight.mutable_data_ptr(),
                       centered ? dbias.mutable_data_ptr() : nullptr,
                       rows,
                       n,
                       nullptr,
                       sc.defined() ? sc.const_data_ptr() : nullptr};
  if (x.is_cuda()) {
    launch_cuda_backward(op, x, p);
  } else {
    norm_backward_cpu(p);
  }
  return {dx, dweight, dbias};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward_impl(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                                            const Tensor& mean, const Tensor& rstd,
                                                            OptVersion version) {
  return norm_backward("layer_norm_backward", NormKind::kLayerNorm, dy, x, weight, &mean, rstd, version);
}

// dsum: a gradient that reaches x directly, added to dx in the same pass (fused_add_rms_norm's).
std::tuple<Tensor, Tensor> rms_norm_backward_impl(const Tensor& dy, const Tensor& x, const OptTensor& weight,
                                                  const Tensor& rstd, OptVersion version, const OptTensor& dsum) {
  auto out = norm_backward("rms_norm_backward", NormKind::kRmsNorm, dy, x, weight, nullptr, rstd, version, dsum);
  return {std::get<0>(out), std::get<1>(out)};
}

// What version=None runs (any device, meta included): the rung; the rung itself streams rows
// too long for registers.
std::string norm_default_choice(c10::string_view op_name, const Tensor& x) {
  const auto name = ::course::as_std(op_name);
  check_x("norm_default_choice", x);
  if (name == "layer_norm" || name == "rms_norm") return ::course::version_name(kNormVersions, default_norm());
  if (name == "layer_norm_backward" || name == "rms_norm_backward") {
    return ::course::version_name(kBackwardVersions, default_norm_backward());
  }
  TORCH_CHECK(name == "fused_add_rms_norm", "norm_default_choice: unknown op '", std::string(name),
              "' (layer_norm, rms_norm, fused_add_rms_norm, layer_norm_backward, rms_norm_backward)");
  return ::course::version_name(kAddVersions, default_add_norm());
}

// Whether the backward of op (layer_norm or rms_norm) for x sums dweight and dbias in the one
// launch at few rows (the column tiles beside the dx blocks) rather than in partial rows, when its
// resident kernel runs `blocks` blocks on a GPU of `sms` SMs (backward_column_pass in norm.h; the
// launcher asks it with the grid the GPU keeps resident), for freshly allocated (16-byte aligned)
// tensors as the glue's are: rows of whole 16-byte vectors read a vector a lane down the columns.
bool norm_backward_column_pass(c10::string_view op_name, const Tensor& x, int64_t blocks, int64_t sms) {
  const auto name = ::course::as_std(op_name);
  check_x("norm_backward_column_pass", x);
  TORCH_CHECK(name == "layer_norm" || name == "rms_norm", "norm_backward_column_pass: unknown op '",
              std::string(name), "' (layer_norm, rms_norm)");
  TORCH_CHECK(blocks >= 1, "norm_backward_column_pass: blocks must be at least 1, got ", std::to_string(blocks));
  TORCH_CHECK(sms >= 1, "norm_backward_column_pass: sms must be at least 1, got ", std::to_string(sms));
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int elem = static_cast<int>(x.element_size());
  const int cols = n % (16 / elem) == 0 ? 16 / elem : 1;
  return backward_column_pass(rows, n, elem, cols, name == "layer_norm", blocks, static_cast<int>(sms));
}

// The column tiles of the backward's one launch at few rows for x on a GPU of `sms` SMs,
// [lanes, cols, tiles] (column_pass_tiles in norm.h), for freshly allocated (16-byte aligned)
// tensors as the glue's are: rows of whole 16-byte vectors take a vector a lane, others one
// element. Asked without a GPU by the CPU tests of the rule.
std::vector<int64_t> norm_backward_column_tiles(const Tensor& x, int64_t sms, std::optional<int64_t> max_tiles) {
  check_x("norm_backward_column_tiles", x);
  TORCH_CHECK(sms >= 1, "norm_backward_column_tiles: sms must be at least 1, got ", std::to_string(sms));
  TORCH_CHECK(!max_tiles.has_value() || *max_tiles >= 1, "norm_backward_column_tiles: max_tiles must be at least 1, got ",
              std::to_string(max_tiles.value_or(0)));
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int elem = static_cast<int>(x.element_size());
  const int cols = n % (16 / elem) == 0 ? 16 / elem : 1;
  const ColumnTiles t = max_tiles.has_value() ? column_pass_tiles(n, cols, elem, static_cast<int>(sms), *max_tiles)
                                              : column_pass_tiles(n, cols, elem, static_cast<int>(sms));
  return {t.lanes, cols, t.tiles};
}

// Which of the forward's resident kernels a launch for x would run on a GPU of `sms` SMs where the
// plain kernel keeps blocks_per_sm blocks an SM and the one that holds weight and bias keeps
// held_blocks_per_sm (the launch asks the runtime for both occupancies; norm.h's forward_params and
// forward_caps_registers): "held", "prefetch", "capped", "plain", or "streamed" past the
// registers; for freshly allocated (16-byte aligned) tensors. two_pass_blocks_per_sm: v1's kernel's
// occupancy, where the launch asks forward_streams (COURSE_NORM_FORWARD_RULE=new, its default), or
// 0 for the rule before it ("old"); "two_pass" where LayerNorm's rows stream with v1's kernel
// (op: "layer_norm", "rms_norm" or "fused_add_rms_norm"). Asked without a GPU by the CPU tests of
// the rule.
std::string norm_forward_variant(const Tensor& x, int64_t sms, int64_t blocks_per_sm, int64_t held_blocks_per_sm,
                                 int64_t two_pass_blocks_per_sm, c10::string_view op_name) {
  check_x("norm_forward_variant", x);
  TORCH_CHECK(sms >= 1, "norm_forward_variant: sms must be at least 1, got ", std::to_string(sms));
  TORCH_CHECK(blocks_per_sm >= 1, "norm_forward_variant: blocks_per_sm must be at least 1, got ",
              std::to_string(blocks_per_sm));
  TORCH_CHECK(held_blocks_per_sm >= 1, "norm_forward_variant: held_blocks_per_sm must be at least 1, got ",
              std::to_string(held_blocks_per_sm));
  TORCH_CHECK(two_pass_blocks_per_sm >= 0, "norm_forward_variant: two_pass_blocks_per_sm must be at least 0, got ",
              std::to_string(two_pass_blocks_per_sm));
  const auto op = ::course::as_std(op_name);
  TORCH_CHECK(op == "layer_norm" || op == "rms_norm" || op == "fused_add_rms_norm",
              "norm_forward_variant: unknown op '", op, "' (layer_norm, rms_norm, fused_add_rms_norm)");
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int elem = static_cast<int>(x.element_size());
  const int shape = forward_shape(n, elem);
  if (shape < 0) return "streamed";
  const bool whole_vectors = n % (16 / elem) == 0;
  const int few = few_rows_forward_shape(rows, n, elem, whole_vectors, static_cast<int>(sms));
  const NormShape row_shape = few >= 0 ? kFewRowsShapes[few] : kForwardShapes[shape];
  const int threads = row_shape.threads;
  const int per_block = forward_rows_per_block(threads);
  const int64_t blocks = ::course::ceil_div<int64_t>(rows, per_block);
  if (whole_vectors) {  // the variants exist for rows of whole vectors only
    switch (forward_params(blocks, threads * per_block, row_shape.vectors, held_blocks_per_sm * sms,
                           static_cast<int>(sms))) {
      case ParamLoad::kHeld:
        return "held";
      case ParamLoad::kPrefetch:
        return "prefetch";
      case ParamLoad::kLate:
        break;
    }
  }
  const bool cappable = few < 0 && forward_cappable(threads * per_block, per_block, whole_vectors);
  if (few < 0 && two_pass_blocks_per_sm > 0 &&
      forward_streams(op == "layer_norm", rows, n * elem,
                      forward_rows_in_flight(static_cast<int>(blocks_per_sm), per_block, cappable),
                      two_pass_blocks_per_sm, static_cast<int>(sms))) {
    return "two_pass";
  }
  if (cappable && forward_caps_registers(static_cast<int>(blocks_per_sm), per_block)) {
    return "capped";
  }
  return "plain";
}

// The row shape a forward launch for x would hold its rows in on a GPU of `sms` SMs (norm.h's
// kForwardShapes, or kFewRowsShapes at few rows: few_rows_forward_shape): [threads a row, 16-byte
// vectors a thread], or [] where the rows are streamed; for freshly allocated (16-byte aligned)
// tensors. Asked without a GPU by the CPU tests of the rule.
std::vector<int64_t> norm_forward_shape(const Tensor& x, int64_t sms) {
  check_x("norm_forward_shape", x);
  TORCH_CHECK(sms >= 1, "norm_forward_shape: sms must be at least 1, got ", std::to_string(sms));
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int elem = static_cast<int>(x.element_size());
  const int shape = forward_shape(n, elem);
  if (shape < 0) return {};
  const int few = few_rows_forward_shape(rows, n, elem, n % (16 / elem) == 0, static_cast<int>(sms));
  const NormShape s = few >= 0 ? kFewRowsShapes[few] : kForwardShapes[shape];
  return {s.threads, s.vectors};
}

// ---------------------------------------------------------------------------------------
// Autograd. Each forward re-enters the dispatcher below the Autograd key (reaching the kernels
// above, or the Meta ones under torch.compile) and saves what the backward kernels need; the
// backward is this chapter's own kernel, reached through its op. The backward ops have no
// derivative of their own: double backward is not supported.
// ---------------------------------------------------------------------------------------
using ::course::find_op;

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps, OptVersion version) {
    static auto op = find_op<decltype(layer_norm_forward_impl)>("fusion::layer_norm_forward");
    Tensor y, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, mean, rstd) = op.call(x, weight, bias, eps, version);
    }
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    // mean and rstd take no gradient, yet with materialized grads autograd would hand the backward
    // a tensor of zeros for each (a fill kernel apiece, launched before the backward's own: at few
    // rows, where every launch is mostly latency, two of the three). Undefined, they cost nothing.
    ctx->set_materialize_grads(false);
    return {y, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(layer_norm_backward_impl)>("fusion::layer_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};  // y unused: no gradient
    const auto s = ctx->get_saved_variables();
    auto [dx, dweight, dbias] = op.call(grads[0], s[0], s[1], s[2], s[3], std::nullopt);
    return {dx, dweight, dbias, Tensor(), Tensor()};
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps,
                               OptVersion version) {
    static auto op = find_op<decltype(rms_norm_forward_impl)>("fusion::rms_norm_forward");
    Tensor y, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, rstd) = op.call(x, weight, eps, version);
    }
    ctx->save_for_backward({x, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);  // no fill of zeros for rstd's gradient (LayerNormFunction says why)
    return {y, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(rms_norm_backward_impl)>("fusion::rms_norm_backward");
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};  // y unused: no gradient
    const auto s = ctx->get_saved_variables();
    auto [dx, dweight] = op.call(grads[0], s[0], s[1], s[2], std::nullopt, std::nullopt);
    return {dx, dweight, Tensor(), Tensor()};
  }
};

// h = x + residual, y = rms_norm(h): dh = rms_norm's dx + the gradient reaching h directly,
// and both x and residual receive dh. The backward kernel adds that gradient (dsum) to dx before
// it stores it: one pass over the rows, where a separate add re-read dx. Grads are not
// materialized: an output nobody used comes as an undefined tensor, not a tensor of zeros that a
// fill kernel writes and the backward reads.
class FusedAddRmsNormFunction : public torch::autograd::Function<FusedAddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               double eps, OptVersion version) {
    static auto op = find_op<decltype(fused_add_rms_norm_forward_impl)>("fusion::fused_add_rms_norm_forward");
    Tensor y, sum, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(y, sum, rstd) = op.call(x, residual, weight, eps, version);
    }
    ctx->save_for_backward({sum, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {y, sum, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(rms_norm_backward_impl)>("fusion::rms_norm_backward");
    const auto s = ctx->get_saved_variables();
    if (!grads[0].defined() && !grads[1].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    if (!grads[0].defined()) {  // only h was used: y's gradient is zero, and so is its share of dweight
      return {grads[1], grads[1], at::zeros_like(s[1]), Tensor(), Tensor()};
    }
    auto [dh, dweight] = op.call(grads[0], s[0], s[1], s[2], std::nullopt,
                                 grads[1].defined() ? OptTensor(grads[1]) : OptTensor());
    return {dh, dh, dweight, Tensor(), Tensor()};
  }
};

// A weight or bias of None reaches the Functions as the ones or zeros it stands for (param_or),
// which require no gradient: autograd drops what the backward computes for them.
std::tuple<Tensor, Tensor, Tensor> layer_norm_forward_autograd(const Tensor& x, const OptTensor& weight,
                                                               const OptTensor& bias, double eps, OptVersion version) {
  check_x("layer_norm", x);
  auto out = LayerNormFunction::apply(x, param_or("layer_norm", "weight", weight, x, 1.0),
                                      param_or("layer_norm", "bias", bias, x, 0.0), eps, version);
  return {out[0], out[1], out[2]};
}
Tensor layer_norm_autograd(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                           OptVersion version) {
  return std::get<0>(layer_norm_forward_autograd(x, weight, bias, eps, version));
}
std::tuple<Tensor, Tensor> rms_norm_forward_autograd(const Tensor& x, const OptTensor& weight, double eps,
                                                     OptVersion version) {
  check_x("rms_norm", x);
  auto out = RmsNormFunction::apply(x, param_or("rms_norm", "weight", weight, x, 1.0), eps, version);
  return {out[0], out[1]};
}
Tensor rms_norm_autograd(const Tensor& x, const OptTensor& weight, double eps, OptVersion version) {
  return std::get<0>(rms_norm_forward_autograd(x, weight, eps, version));
}
std::tuple<Tensor, Tensor, Tensor> fused_add_rms_norm_forward_autograd(const Tensor& x, const Tensor& residual,
                                                                       const OptTensor& weight, double eps,
                                                                       OptVersion version) {
  check_x("fused_add_rms_norm", x);
  auto out = FusedAddRmsNormFunction::apply(x, residual, param_or("fused_add_rms_norm", "weight", weight, x, 1.0), eps,
                                            version);
  return {out[0], out[1], out[2]};
}
std::tuple<Tensor, Tensor> fused_add_rms_norm_autograd(const Tensor& x, const Tensor& residual, const OptTensor& weight,
                                                       double eps, OptVersion version) {
  auto out = fused_add_rms_norm_forward_autograd(x, residual, weight, eps, version);
  return {std::get<0>(out), std::get<1>(out)};
}

}  // namespace
}  // namespace norm

std::optional<std::vector<std::string>> norm_versions(std::string_view op) {
  if (op == "layer_norm" || op == "rms_norm") return ::course::version_names(norm::kNormVersions);
  if (op == "layer_norm_backward" || op == "rms_norm_backward") return ::course::version_names(norm::kBackwardVersions);
  if (op == "fused_add_rms_norm") return ::course::version_names(norm::kAddVersions);
  return std::nullopt;
}

}  // namespace fusion

TORCH_LIBRARY_FRAGMENT(fusion, m) {
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05, str? version=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps=1e-06, str? version=None) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps=1e-06, str? version=None)"
        " -> (Tensor, Tensor)");
  m.def("layer_norm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps=1e-05, str? version=None)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_forward(Tensor x, Tensor? weight, float eps=1e-06, str? version=None) -> (Tensor, Tensor)");
  m.def("fused_add_rms_norm_forward(Tensor x, Tensor residual, Tensor? weight, float eps=1e-06, str? version=None)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, str? version=None)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, str? version=None, Tensor? dsum=None)"
        " -> (Tensor, Tensor)");
  m.def("norm_default_choice(str op, Tensor x) -> str", &fusion::norm::norm_default_choice);
  m.def("norm_backward_column_pass(str op, Tensor x, int blocks, int sms) -> bool",
        &fusion::norm::norm_backward_column_pass);
  m.def("norm_backward_column_tiles(Tensor x, int sms, int? max_tiles=None) -> int[]",
        &fusion::norm::norm_backward_column_tiles);
  m.def("norm_forward_variant(Tensor x, int sms, int blocks_per_sm, int held_blocks_per_sm, "
        "int two_pass_blocks_per_sm=0, str op=\"layer_norm\") -> str",
        &fusion::norm::norm_forward_variant);
  m.def("norm_forward_shape(Tensor x, int sms) -> int[]", &fusion::norm::norm_forward_shape);
}

// One implementation per op serves CPU, CUDA and Meta.
static void register_norm_kernels(torch::Library& m) {
  using namespace fusion::norm;  // NOLINT
  m.impl("layer_norm", &layer_norm_impl);
  m.impl("rms_norm", &rms_norm_impl);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_impl);
  m.impl("layer_norm_forward", &layer_norm_forward_impl);
  m.impl("rms_norm_forward", &rms_norm_forward_impl);
  m.impl("fused_add_rms_norm_forward", &fused_add_rms_norm_forward_impl);
  m.impl("layer_norm_backward", &layer_norm_backward_impl);
  m.impl("rms_norm_backward", &rms_norm_backward_impl);
}
TORCH_LIBRARY_IMPL(fusion, CPU, m) { register_norm_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, CUDA, m) { register_norm_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, Meta, m) { register_norm_kernels(m); }
TORCH_LIBRARY_IMPL(fusion, Autograd, m) {
  using namespace fusion::norm;  // NOLINT
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_autograd);
  m.impl("layer_norm_forward", &layer_norm_forward_autograd);
  m.impl("rms_norm_forward", &rms_norm_forward_autograd);
  m.impl("fused_add_rms_norm_forward", &fused_add_rms_norm_forward_autograd);
}
