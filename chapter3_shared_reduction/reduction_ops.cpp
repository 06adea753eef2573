// Torch glue for chapter 3: op schemas, input checks, version parsing, the CPU/CUDA/Meta
// kernels, autograd, and registration with the dispatcher (the structure of chapters 1-2: ops
// declared once, one implementation per op serving every backend).
#include "reduction.h"

#include <ATen/ATen.h>
#include <course/checks.h>
#include <course/dispatch.h>
#include <course/on_cuda.h>
#include <course/versions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <optional>
#include <string>
#include <vector>

namespace shared_reduction {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using ::course::OptVersion;

// The tables of versions the extension dispatches; shared_reduction.VERSIONS is tested against
// them through the `versions` op. One table for sum and amax: three ladders, told apart by
// layout_of (reduction.h).
constexpr ::course::NamedVersion<ReduceVersion> kReduceVersions[] = {
    {"v1", ReduceVersion::kInterleavedDivergent}, {"v2", ReduceVersion::kInterleavedStrided},
    {"v3", ReduceVersion::kSequential},           {"v4", ReduceVersion::kFirstAddDuringLoad},
    {"v5", ReduceVersion::kUnrollLastWarp},       {"v6", ReduceVersion::kCompleteUnroll},
    {"v7", ReduceVersion::kManyPerThread},        {"v8", ReduceVersion::kWarpShuffle},
    {"v9", ReduceVersion::kVectorized},           {"v10", ReduceVersion::kOnePass},
    {"block_per_row", ReduceVersion::kBlockPerRow}, {"warp_per_row", ReduceVersion::kWarpPerRow},
    {"rows_per_warp", ReduceVersion::kRowsPerWarp}, {"split_row", ReduceVersion::kSplitRow},
    {"column_loop", ReduceVersion::kColumnLoop},  {"column_split", ReduceVersion::kColumnSplit},
};
constexpr ::course::NamedVersion<SoftmaxVersion> kSoftmaxVersions[] = {
    {"v1", SoftmaxVersion::kThreePasses}, {"v2", SoftmaxVersion::kBlockPerRow},
    {"v3", SoftmaxVersion::kOnline},      {"v4", SoftmaxVersion::kResidentRow},
    {"v5", SoftmaxVersion::kSplitRow},
};

std::vector<std::string> versions(c10::string_view op) {
  const auto name = ::course::as_std(op);
  if (name == "sum" || name == "amax") return ::course::version_names(kReduceVersions);
  if (name == "softmax" || name == "log_softmax") return ::course::version_names(kSoftmaxVersions);
  TORCH_CHECK(false, "versions: unknown op '", std::string(name), "' (ops with a ladder: sum, amax, "
              "softmax, log_softmax)");
}

using ::course::to_dtype;

using ::course::check_input;

// dim in [-ndim, ndim) (a 0-d tensor has one dim, as in torch), as a non-negative index.
int64_t wrap_dim(const char* op, int64_t dim, int64_t ndim) {
  const int64_t rank = ndim == 0 ? 1 : ndim;
  TORCH_CHECK(dim >= -rank && dim < rank, op, ": dim ", std::to_string(dim), " is out of range for a ",
              std::to_string(ndim), "-D tensor (expected a dim in [", std::to_string(-rank), ", ",
              std::to_string(rank - 1), "])");
  return dim < 0 ? dim + rank : dim;
}

// Scratch for one launch, as the launcher asked for it (counters zero-filled).
struct Scratch {
  Tensor bytes, counters;
  void* data() const { return bytes.defined() ? bytes.data_ptr() : nullptr; }
  unsigned* counter_data() const {
    return counters.defined() ? reinterpret_cast<unsigned*>(counters.data_ptr<int32_t>()) : nullptr;
  }
};

Scratch allocate(const Workspace& ws, const Tensor& like) {
  Scratch s;
  if (ws.bytes > 0) s.bytes = at::empty({ws.bytes}, like.options().dtype(at::kByte));
  if (ws.counters > 0) s.counters = at::zeros({ws.counters}, like.options().dtype(at::kInt));
  return s;
}

// Runs the CUDA launcher (after asking for and allocating its scratch) on x's device and
// current stream, or the CPU implementation.
template <typename Params, typename Query, typename Launch, typename Cpu>
void run(const char* op, const Tensor& x, Params p, Query query, Launch launch, Cpu cpu) {
  if (x.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard device_guard(x.device());
    Workspace ws;
    C10_CUDA_CHECK(query(p, &ws));
    const Scratch scratch = allocate(ws, x);
    p.workspace = scratch.data();
    p.counters = scratch.counter_data();
    C10_CUDA_CHECK(launch(p, c10::cuda::getCurrentCUDAStream(x.device().index())));
#else
    (void)query;
    (void)launch;
    ::course::fail_no_cuda_kernels(op, "shared_reduction");
#endif
  } else {
    cpu(p);
  }
}

// The CUDA entry points exist only in a CUDA build; a CPU-only build passes nullptr, never called.
#ifdef WITH_CUDA
#define SHARED_REDUCTION_CUDA(fn) fn
#else
#define SHARED_REDUCTION_CUDA(fn) nullptr
#endif

// ---------------------------------------------------------------------------------------
// sum and amax
// ---------------------------------------------------------------------------------------

// x seen as (outer, n, inner) for a reduction over `dim` (nullopt: everything, one row).
struct ReduceShape {
  bool whole;
  int64_t dim;  // wrapped; unused when whole
  int64_t outer, n, inner;
};

ReduceShape reduce_shape(const char* op, const Tensor& x, std::optional<int64_t> dim) {
  if (!dim.has_value()) return {true, 0, 1, x.numel(), 1};
  const int64_t d = wrap_dim(op, *dim, x.dim());
  if (x.dim() == 0) return {false, 0, 1, 1, 1};
  int64_t outer = 1;
  int64_t inner = 1;
  for (int64_t i = 0; i < d; ++i) outer *= x.size(i);
  for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
  return {false, d, outer, x.size(d), inner};
}

Layout layout_of_shape(const ReduceShape& s) {
  return s.whole ? Layout::kWhole : (s.inner == 1 ? Layout::kRows : Layout::kColumns);
}

const char* layout_name(Layout l) {
  return l == Layout::kWhole ? "the whole tensor" : (l == Layout::kRows ? "rows" : "columns");
}
const char* ladder_name(Layout l) {
  return l == Layout::kWhole ? "whole-tensor" : (l == Layout::kRows ? "rows" : "columns");
}

std::string rungs_of(Layout l) {
  std::string list;
  for (const auto& v : kReduceVersions) {
    if (layout_of(v.version) == l) list += (list.empty() ? "" : ", ") + std::string(v.name);
  }
  return list;
}

ReduceVersion dispatch_reduce(const ReduceShape& s, int sms) {
  return default_reduce(s.outer, s.n, s.inner, s.whole, sms);
}

// The rung a call runs: the requested one, which must belong to the ladder of the call's
// layout, or the dispatch's (for the SM count of x's GPU).
ReduceVersion pick_reduce(const char* op, const ReduceShape& s, OptVersion version, const Tensor& x) {
  const std::optional<ReduceVersion> requested = ::course::parse_version(op, version, kReduceVersions);
  const Layout layout = layout_of_shape(s);
  if (!requested.has_value()) return dispatch_reduce(s, ::course::device_sms(x));
  const Layout rung_layout = layout_of(*requested);
  TORCH_CHECK(rung_layout == layout, op, ": version '", std::string(::course::as_std(*version)),
              "' is a rung of the ", ladder_name(rung_layout), " ladder, but this call reduces ",
              layout_name(layout),
              s.whole ? std::string(" (dim=None)")
                      : " (dim=" + std::to_string(s.dim) + " of " + ::course::shape_str(x.sizes()) + ")",
              "; rungs for ", layout_name(layout), ": ", rungs_of(layout));
  return *requested;
}

// The result's sizes: the reduced dim dropped (or kept as 1), every dim for dim=None.
std::vector<c10::SymInt> reduced_sizes(const Tensor& x, const ReduceShape& s, bool keepdim) {
  std::vector<c10::SymInt> sizes;
  for (int64_t i = 0; i < x.dim(); ++i) {
    const bool reduced = s.whole || i == s.dim;
    if (!reduced) {
      sizes.push_back(x.sym_size(i));
    } else if (keepdim) {
      sizes.emplace_back(1);
    }
  }
  return sizes;
}

Tensor reduce_impl(const char* op, ReduceOp kind, const Tensor& x, std::optional<int64_t> dim,
                   bool keepdim, OptVersion version) {
  check_input(op, "x", x);
  if (x.is_meta()) {
    // Shapes only, possibly symbolic (torch.compile, opcheck): nothing may ask for a concrete
    // size, so the layout check waits for a real tensor.
    ::course::parse_version(op, version, kReduceVersions);
    const ReduceShape s{!dim.has_value(), dim.has_value() ? wrap_dim(op, *dim, x.dim()) : 0, 0, 0, 0};
    return at::empty_symint(reduced_sizes(x, s, keepdim), x.options());
  }
  const ReduceShape s = reduce_shape(op, x, dim);
  const Tensor xc = x.contiguous();
  const ReduceVersion v = pick_reduce(op, s, version, x);
  Tensor out = at::empty_symint(reduced_sizes(x, s, keepdim), x.options());
  if (out.numel() == 0) return out;
  if (s.n == 0) {
    TORCH_CHECK(kind == ReduceOp::kSum, op, ": cannot reduce over zero elements (x has shape ",
                ::course::shape_str(x.sizes()), s.whole ? std::string(", dim=None") : ", dim=" + std::to_string(s.dim),
                "): the maximum of nothing is undefined");
    return out.zero_();  // the empty sum
  }
  ReduceParams p{kind, v, to_dtype(x.scalar_type()), xc.const_data_ptr(), out.mutable_data_ptr(),
                 s.outer, s.n, s.inner, nullptr, nullptr};
  run(op, xc, p, SHARED_REDUCTION_CUDA(reduce_workspace), SHARED_REDUCTION_CUDA(launch_reduce), reduce_cpu);
  return out;
}

Tensor sum_impl(const Tensor& x, std::optional<int64_t> dim, bool keepdim, OptVersion version) {
  return reduce_impl("sum", ReduceOp::kSum, x, dim, keepdim, version);
}

Tensor amax_impl(const Tensor& x, std::optional<int64_t> dim, bool keepdim, OptVersion version) {
  return reduce_impl("amax", ReduceOp::kMax, x, dim, keepdim, version);
}

Tensor atomic_sum_impl(const Tensor& x) {
  check_input("atomic_sum", "x", x);
  ::course::check_dtype_in("atomic_sum", "x", x, {at::kFloat});
  Tensor out = at::zeros({}, x.options());
  if (x.is_meta() || x.numel() == 0) return out;
  const Tensor xc = x.contiguous();
  if (!x.is_cuda()) {
    const ReduceParams p{ReduceOp::kSum, ReduceVersion::kOnePass, DType::kFloat32, xc.const_data_ptr(),
                         out.mutable_data_ptr(), 1, xc.numel(), 1, nullptr, nullptr};
    reduce_cpu(p);
    return out;
  }
#ifdef WITH_CUDA
  const c10::cuda::CUDAGuard device_guard(x.device());
  const AtomicSumParams p{xc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), xc.numel()};
  C10_CUDA_CHECK(launch_atomic_sum(p, c10::cuda::getCurrentCUDAStream(x.device().index())));
#else
  ::course::fail_no_cuda_kernels("atomic_sum", "shared_reduction");
#endif
  return out;
}

// ---------------------------------------------------------------------------------------
// softmax, log_softmax and their backward
// ---------------------------------------------------------------------------------------

// The kernels take rows of adjacent elements: `dim` is moved last (a copy unless it is last
// already) and the result moved back, contiguous like torch.softmax's.
Tensor rows_last(const Tensor& t, int64_t d) {
  return (t.dim() == 0 ? t.reshape({1}) : t.movedim(d, -1)).contiguous();
}
Tensor rows_back(const Tensor& rows, const Tensor& like, int64_t d) {
  return like.dim() == 0 ? rows.reshape({}) : rows.movedim(-1, d).contiguous();
}

Tensor softmax_common(const char* op, bool log, const Tensor& x, int64_t dim, OptVersion version) {
  check_input(op, "x", x);
  const int64_t d = wrap_dim(op, dim, x.dim());
  const std::optional<SoftmaxVersion> requested = ::course::parse_version(op, version, kSoftmaxVersions);
  if (x.is_meta()) return at::empty_like(x, at::MemoryFormat::Contiguous);
  const Tensor rows = rows_last(x, d);
  Tensor out = at::empty_like(rows);
  if (rows.numel() == 0) return rows_back(out, x, d);
  const int64_t n = rows.size(-1);
  const int elem = static_cast<int>(x.element_size());
  SoftmaxParams p{requested.value_or(default_softmax(n, elem)), to_dtype(x.scalar_type()), log,
                  rows.const_data_ptr(), out.mutable_data_ptr(), rows.numel() / n, n, nullptr, nullptr};
  run(op, rows, p, SHARED_REDUCTION_CUDA(softmax_workspace), SHARED_REDUCTION_CUDA(launch_softmax), softmax_cpu);
  return rows_back(out, x, d);
}

Tensor softmax_impl(const Tensor& x, int64_t dim, OptVersion version) {
  return softmax_common("softmax", false, x, dim, version);
}
Tensor log_softmax_impl(const Tensor& x, int64_t dim, OptVersion version) {
  return softmax_common("log_softmax", true, x, dim, version);
}

Tensor softmax_backward_impl(const Tensor& grad, const Tensor& y, int64_t dim, bool log) {
  const char* op = "softmax_backward";
  check_input(op, "grad", grad);
  check_input(op, "y", y);
  CHECK_SAME_DEVICE(op, grad, y);
  CHECK_SAME_DTYPE(op, grad, y);
  const int64_t d = wrap_dim(op, dim, y.dim());
  if (y.is_meta()) {
    TORCH_CHECK(grad.sym_sizes() == y.sym_sizes(), op, ": grad and y must have the same shape");
    return at::empty_like(y, at::MemoryFormat::Contiguous);
  }
  TORCH_CHECK(grad.sizes() == y.sizes(), op, ": grad has shape ", ::course::shape_str(grad.sizes()),
              " but y has shape ", ::course::shape_str(y.sizes()));
  const Tensor yr = rows_last(y, d);
  const Tensor gr = rows_last(grad, d);
  Tensor out = at::empty_like(yr);
  if (yr.numel() == 0) return rows_back(out, y, d);
  const int64_t n = yr.size(-1);
  SoftmaxBackwardParams p{to_dtype(y.scalar_type()), log, yr.const_data_ptr(), gr.const_data_ptr(),
                          out.mutable_data_ptr(), yr.numel() / n, n, nullptr, nullptr};
  run(op, yr, p, SHARED_REDUCTION_CUDA(softmax_backward_workspace),
      SHARED_REDUCTION_CUDA(launch_softmax_backward), softmax_backward_cpu);
  return rows_back(out, y, d);
}

// What op(x, dim, version=None) runs on a GPU of `sms` SMs, from shape and dtype alone (any
// device, meta included).
std::string default_choice(c10::string_view op_name, const Tensor& x, std::optional<int64_t> dim, int64_t sms) {
  const auto name = ::course::as_std(op_name);
  check_input("default_choice", "x", x);
  TORCH_CHECK(sms >= 1, "default_choice: sms must be >= 1, got ", std::to_string(sms));
  if (name == "sum" || name == "amax") {
    const ReduceShape s = reduce_shape("default_choice", x, dim);
    return ::course::version_name(kReduceVersions, dispatch_reduce(s, static_cast<int>(sms)));
  }
  const int64_t d = wrap_dim("default_choice", dim.value_or(-1), x.dim());
  const int64_t n = x.dim() == 0 ? 1 : x.size(d);
  const int elem = static_cast<int>(x.element_size());
  if (name == "softmax" || name == "log_softmax") {
    return ::course::version_name(kSoftmaxVersions, default_softmax(n, elem));
  }
  TORCH_CHECK(name == "softmax_backward", "default_choice: unknown op '", std::string(name),
              "' (sum, amax, softmax, log_softmax, softmax_backward)");
  const int64_t rows = x.dim() == 0 || n == 0 ? 1 : x.numel() / n;
  const RowPlan plan = plan_row(n, elem, true, true, static_cast<int>(sms), rows);
  switch (plan.kind) {
    case RowPlanKind::kResident: return "resident";
    case RowPlanKind::kShared: return "shared";
    case RowPlanKind::kSplit: return "split";
    case RowPlanKind::kStreamed: break;
  }
  return "streamed";
}

// The index width column_loop takes for x reduced over `dim`, from its shape alone (any device,
// meta included): 32 (course::FastDivmod by inner) or 64 (the compiler's division), as
// column_loop_fits_32_bits (reduction.h) decides at launch.
int64_t column_loop_index_bits(const Tensor& x, int64_t dim) {
  check_input("column_loop_index_bits", "x", x);
  const ReduceShape s = reduce_shape("column_loop_index_bits", x, dim);
  return column_loop_fits_32_bits(s.outer, s.n, s.inner) ? 32 : 64;
}

// ---------------------------------------------------------------------------------------
// Autograd. Each forward re-enters the dispatcher below the Autograd key, reaching the kernels
// above; the softmax backward is this chapter's own kernel, the others are ATen expressions.
// ---------------------------------------------------------------------------------------
using ::course::find_op;

c10::IValue saved_version(OptVersion version) {
  return version.has_value() ? c10::IValue(std::string(::course::as_std(*version))) : c10::IValue();
}

// The gradient (or anything of the result's shape) reshaped so it broadcasts against x: the
// reduced dims put back as size 1.
Tensor unreduce(const Tensor& g, at::IntArrayRef sizes, const c10::IValue& dim, bool keepdim) {
  if (dim.isNone()) return g.reshape(std::vector<int64_t>(sizes.size(), 1));
  return keepdim || sizes.empty() ? g : g.unsqueeze(dim.toInt());
}

void save_reduce(const char* op, AutogradContext* ctx, const Tensor& x, std::optional<int64_t> dim,
                 bool keepdim) {
  ctx->saved_data["sizes"] = x.sizes();
  ctx->saved_data["dim"] = dim.has_value() ? c10::IValue(wrap_dim(op, *dim, x.dim())) : c10::IValue();
  ctx->saved_data["keepdim"] = keepdim;
}

class SumFunction : public torch::autograd::Function<SumFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::optional<int64_t> dim, bool keepdim,
                        OptVersion version) {
    static auto op = find_op<decltype(sum_impl)>("shared_reduction::sum");
    save_reduce("sum", ctx, x, dim, keepdim);
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, dim, keepdim, version);
  }
  // Every element contributes with weight 1: the gradient spreads back over the reduced dims.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const Tensor g = unreduce(grads[0], sizes, ctx->saved_data["dim"], ctx->saved_data["keepdim"].toBool());
    return {g.expand(sizes).contiguous(), Tensor(), Tensor(), Tensor()};
  }
};

class AmaxFunction : public torch::autograd::Function<AmaxFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::optional<int64_t> dim, bool keepdim,
                        OptVersion version) {
    static auto op = find_op<decltype(amax_impl)>("shared_reduction::amax");
    save_reduce("amax", ctx, x, dim, keepdim);
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = op.call(x, dim, keepdim, version);
    }
    ctx->save_for_backward({x, out});
    return out;
  }
  // As torch.amax: the gradient goes to the elements equal to the maximum, shared evenly
  // among ties.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto& dim = ctx->saved_data["dim"];
    const bool keepdim = ctx->saved_data["keepdim"].toBool();
    const Tensor hit = saved[0].eq(unreduce(saved[1], sizes, dim, keepdim)).to(grads[0].scalar_type());
    const Tensor count = dim.isNone() ? hit.sum() : hit.sum(dim.toInt(), /*keepdim=*/true);
    return {hit * unreduce(grads[0], sizes, dim, keepdim) / count, Tensor(), Tensor(), Tensor()};
  }
};

Tensor call_softmax_backward(const Tensor& grad, const Tensor& y, int64_t dim, bool log) {
  static auto op = find_op<decltype(softmax_backward_impl)>("shared_reduction::softmax_backward");
  return op.call(grad, y, dim, log);
}

template <bool kLog>
class SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction<kLog>> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t dim, OptVersion version) {
    static auto op = find_op<decltype(softmax_impl)>(kLog ? "shared_reduction::log_softmax"
                                                          : "shared_reduction::softmax");
    Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      y = op.call(x, dim, version);
    }
    ctx->saved_data["dim"] = dim;
    ctx->save_for_backward({y});
    return y;
  }
  // dx = y * (dy - sum(dy * y)), or dy - exp(y) * sum(dy) for log_softmax: one fused kernel.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor y = ctx->get_saved_variables()[0];
    return {call_softmax_backward(grads[0].contiguous(), y, ctx->saved_data["dim"].toInt(), kLog), Tensor(),
            Tensor()};
  }
};

// The backward's own derivative (double backward, and what opcheck asks of an op whose inputs
// may require grad), in ATen: for dx = y * (g - S), S = sum(g * y):
//   d/dg = y * (u - sum(u * y)),  d/dy = u * (g - S) - sum(u * y) * g;
// for dx = g - exp(y) * sum(g):
//   d/dg = u - sum(u * exp(y)),   d/dy = -u * exp(y) * sum(g).
class SoftmaxBackwardFunction : public torch::autograd::Function<SoftmaxBackwardFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& grad, const Tensor& y, int64_t dim, bool log) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["log"] = log;
    ctx->save_for_backward({grad, y});
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_softmax_backward(grad, y, dim, log);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& g = saved[0];
    const Tensor& y = saved[1];
    const Tensor& u = grads[0];
    const int64_t d = ctx->saved_data["dim"].toInt();
    if (ctx->saved_data["log"].toBool()) {
      const Tensor e = y.exp();
      return {u - (u * e).sum(d, true), -u * e * g.sum(d, true), Tensor(), Tensor()};
    }
    const Tensor uy = (u * y).sum(d, true);
    return {y * (u - uy), u * (g - (g * y).sum(d, true)) - uy * g, Tensor(), Tensor()};
  }
};

Tensor sum_autograd(const Tensor& x, std::optional<int64_t> dim, bool keepdim, OptVersion version) {
  return SumFunction::apply(x, dim, keepdim, version);
}
Tensor amax_autograd(const Tensor& x, std::optional<int64_t> dim, bool keepdim, OptVersion version) {
  return AmaxFunction::apply(x, dim, keepdim, version);
}
Tensor softmax_autograd(const Tensor& x, int64_t dim, OptVersion version) {
  return SoftmaxFunction<false>::apply(x, dim, version);
}
Tensor log_softmax_autograd(const Tensor& x, int64_t dim, OptVersion version) {
  return SoftmaxFunction<true>::apply(x, dim, version);
}
Tensor softmax_backward_autograd(const Tensor& grad, const Tensor& y, int64_t dim, bool log) {
  return SoftmaxBackwardFunction::apply(grad, y, dim, log);
}

}  // namespace

TORCH_LIBRARY(shared_reduction, m) {
  m.def("sum(Tensor x, int? dim=None, bool keepdim=False, str? version=None) -> Tensor");
  m.def("amax(Tensor x, int? dim=None, bool keepdim=False, str? version=None) -> Tensor");
  m.def("softmax(Tensor x, int dim=-1, str? version=None) -> Tensor");
  m.def("log_softmax(Tensor x, int dim=-1, str? version=None) -> Tensor");
  m.def("softmax_backward(Tensor grad, Tensor y, int dim, bool log) -> Tensor");
  m.def("atomic_sum(Tensor x) -> Tensor");
  m.def("versions(str op) -> str[]", &versions);
  m.def("default_choice(str op, Tensor x, int? dim, int sms) -> str", &default_choice);
  m.def("column_loop_index_bits(Tensor x, int dim) -> int", &column_loop_index_bits);
}

// One implementation per op serves CPU, CUDA and Meta: each picks the backend from the
// (already checked) device, so the checks cannot drift apart between backends.
static void register_backend_kernels(torch::Library& m) {
  m.impl("sum", &sum_impl);
  m.impl("amax", &amax_impl);
  m.impl("softmax", &softmax_impl);
  m.impl("log_softmax", &log_softmax_impl);
  m.impl("softmax_backward", &softmax_backward_impl);
  m.impl("atomic_sum", &atomic_sum_impl);
}
TORCH_LIBRARY_IMPL(shared_reduction, CPU, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(shared_reduction, CUDA, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(shared_reduction, Meta, m) { register_backend_kernels(m); }
TORCH_LIBRARY_IMPL(shared_reduction, Autograd, m) {
  m.impl("sum", &sum_autograd);
  m.impl("amax", &amax_autograd);
  m.impl("softmax", &softmax_autograd);
  m.impl("log_softmax", &log_softmax_autograd);
  m.impl("softmax_backward", &softmax_backward_autograd);
}

}  // namespace shared_reduction
