// Checks the Hopper forward rungs (csrc/hopper/) against a float64 CPU reference at every launch
// shape that matters (sequence lengths around the tile sizes, seqlen_q != seqlen_k, causal, GQA,
// head dims 64/128/256, both 16-bit types, (b, s, h, d) views), then times them: the harness that
// finds a descriptor or barrier bug without building the extension. No torch.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I../../common/include -I../csrc \
//        -o /tmp/hopper_forward_check hopper_forward_check.cu ../csrc/hopper/flash_fwd_*.cu
//   (every forward translation unit: the dispatch links the window and FP8 instantiations too)
//   /tmp/hopper_forward_check             every rung at every shape (exit 1 on a mismatch), then timings
//   /tmp/hopper_forward_check --variants  other configurations (tile, stages, overlap, ping-pong,
//                                         persistent), timed
//   /tmp/hopper_forward_check --compare "persistent joint+pingpong n128 3st" 128 [--quick]
//                                         a row beside its " o4", " o8" rows (how O is stored):
//                                         checked bit for bit against it, then (not --quick) timed
//                                         side by side
//   /tmp/hopper_forward_check --profile "ws n128" 128    one launch of a variant, for ncu
#include "hopper/flash_fwd_hopper.h"
#include "hopper/flash_fwd_hopper_persistent.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace fa = flash_attention;

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    cudaError_t err_ = (call);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

struct Config {
  int b, h, hk, sq, sk, d;
  bool causal, bshd;  // bshd: q, k, v, o stored (batch, seqlen, heads, head_dim), read through strides
  bool fp16;
};

static const char* rung_name(fa::HopperForward r) {
  switch (r) {
    case fa::HopperForward::kWgmma: return "wgmma";
    case fa::HopperForward::kWarpSpecialized: return "warp_specialized";
    case fa::HopperForward::kPingpong: return "pingpong";
    case fa::HopperForward::kPersistent: return "persistent";
  }
  return "?";
}

static float to_float(uint16_t bits, bool fp16) {
  if (fp16) {
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = bits;
  return __bfloat162float(__nv_bfloat16(r));
}
static uint16_t from_float(float x, bool fp16) {
  if (fp16) return static_cast<__half_raw>(__float2half(x)).x;
  return static_cast<__nv_bfloat16_raw>(__float2bfloat16(x)).x;
}

static constexpr fa::HopperForward kRungs[] = {fa::HopperForward::kWgmma, fa::HopperForward::kWarpSpecialized,
                                               fa::HopperForward::kPingpong, fa::HopperForward::kPersistent};

// The persistent rung's workspace (its tile counter, which the launcher clears): one for the program.
static void* workspace() {
  static void* counter = [] {
    void* ptr = nullptr;
    // The padded layout's (the experiment's problems are padded): the counter alone.
    CHECK_CUDA(cudaMalloc(&ptr, fa::attention_forward_hopper_workspace(fa::AttentionParams{},
                                                                       fa::HopperForward::kPersistent)));
    return ptr;
  }();
  return counter;
}

// A tensor of (b, heads, s, d) elements in either layout, with its element strides.
struct Tensor4 {
  int b, heads, s, d;
  bool bshd;
  int64_t sb, sh, ss;
  std::vector<uint16_t> host;
  uint16_t* dev = nullptr;
  Tensor4(int b_, int h_, int s_, int d_, bool bshd_) : b(b_), heads(h_), s(s_), d(d_), bshd(bshd_) {
    if (bshd) {
      ss = static_cast<int64_t>(heads) * d, sh = d, sb = static_cast<int64_t>(s) * heads * d;
    } else {
      ss = d, sh = static_cast<int64_t>(s) * d, sb = static_cast<int64_t>(heads) * s * d;
    }
    host.resize(static_cast<size_t>(b) * heads * s * d);
    CHECK_CUDA(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * 2));
  }
  ~Tensor4() { cudaFree(dev); }
  size_t at(int bi, int hi, int si, int di) const { return bi * sb + hi * sh + si * ss + di; }
};

// N(0, 1) inputs rounded to the 16-bit type, on the host (for the reference) and on the device.
static void fill_random(std::initializer_list<Tensor4*> tensors, std::mt19937& rng, bool fp16) {
  std::normal_distribution<float> dist(0.f, 1.f);
  for (Tensor4* t : tensors) {
    for (auto& x : t->host) x = from_float(dist(rng), fp16);
    CHECK_CUDA(cudaMemcpy(t->dev, t->host.data(), t->host.size() * 2, cudaMemcpyHostToDevice));
  }
}

// The median of 20 timed calls after 3 untimed ones, CUDA events around each, in ms.
template <typename Launch>
static double median_ms(Launch launch) {
  for (int i = 0; i < 3; ++i) CHECK_CUDA(launch());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// o_i = sum_j softmax(scale * q_i . k_j) v_j over row i's visible keys, in float64.
static void reference_row(const Config& c, const Tensor4& q, const Tensor4& k, const Tensor4& v, int bi, int hi,
                          int i, std::vector<double>& out, double& lse) {
  const int hki = hi / (c.h / c.hk);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  int64_t visible = c.sk;
  if (c.causal) visible = std::max<int64_t>(0, std::min<int64_t>(c.sk, i + c.sk - c.sq + 1));
  std::vector<double> s(visible);
  double mx = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    double dot = 0.0;
    for (int e = 0; e < c.d; ++e) {
      dot += static_cast<double>(to_float(q.host[q.at(bi, hi, i, e)], c.fp16)) *
             to_float(k.host[k.at(bi, hki, static_cast<int>(j), e)], c.fp16);
    }
    s[j] = dot * scale;
    mx = std::max(mx, s[j]);
  }
  double sum = 0.0;
  for (auto& x : s) sum += (x = std::exp(x - mx));
  out.assign(c.d, 0.0);
  for (int64_t j = 0; j < visible; ++j) {
    for (int e = 0; e < c.d; ++e) out[e] += s[j] / sum * to_float(v.host[v.at(bi, hki, static_cast<int>(j), e)], c.fp16);
  }
  lse = visible > 0 ? mx + std::log(sum) : -INFINITY;
}

static fa::AttentionParams make_params(const Config& c, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                       const Tensor4& o, float* lse) {
  fa::AttentionParams p{};
  p.dtype = c.fp16 ? fa::DType::kFloat16 : fa::DType::kBFloat16;
  p.q = q.dev, p.k = k.dev, p.v = v.dev, p.o = o.dev, p.lse = lse;
  p.batch = c.b, p.heads = c.h, p.heads_kv = c.hk, p.seqlen_q = c.sq, p.seqlen_k = c.sk, p.head_dim = c.d;
  p.q_batch_stride = q.sb, p.q_head_stride = q.sh, p.q_seq_stride = q.ss;
  p.k_batch_stride = k.sb, p.k_head_stride = k.sh, p.k_seq_stride = k.ss;
  p.v_batch_stride = v.sb, p.v_head_stride = v.sh, p.v_seq_stride = v.ss;
  p.o_batch_stride = o.sb, p.o_head_stride = o.sh, p.o_seq_stride = o.ss;
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  p.causal = c.causal;
  return p;
}

// The rows a check holds to float64: every row of a small problem, else `random` rows drawn at random
// plus, in the last (batch, head), the rows where a warp's halves, the warpgroups and the tiles begin
// and end, and the last row.
struct Reference {
  std::vector<int> rows;  // flat (batch, head, row) indices
  std::vector<std::vector<double>> o;
  std::vector<double> lse;
};
static Reference reference_rows(const Config& c, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                                std::mt19937& rng, int random) {
  Reference ref;
  const size_t rows = static_cast<size_t>(c.b) * c.h * c.sq;
  if (rows <= 768) {
    for (size_t r = 0; r < rows; ++r) ref.rows.push_back(static_cast<int>(r));
  } else {
    std::uniform_int_distribution<int> pick(0, static_cast<int>(rows) - 1);
    for (int n = 0; n < random; ++n) ref.rows.push_back(pick(rng));
    for (int i : {0, 7, 8, 63, 64, 127, 128, c.sq - 1}) {
      if (i >= 0 && i < c.sq) ref.rows.push_back((c.b - 1) * c.h * c.sq + (c.h - 1) * c.sq + i);
    }
  }
  ref.o.resize(ref.rows.size());
  ref.lse.resize(ref.rows.size());
  for (size_t n = 0; n < ref.rows.size(); ++n) {
    const int r = ref.rows[n], bi = r / (c.h * c.sq), hi = (r / c.sq) % c.h, i = r % c.sq;
    reference_row(c, q, k, v, bi, hi, i, ref.o[n], ref.lse[n]);
  }
  return ref;
}

// One launch's o and lse read back (both NaN-poisoned before it) and held to the reference: no
// element left unwritten, the sampled rows' error relative to their norm within 16-bit P's and the
// output's rounding (a few 2^-9 for bfloat16, 2^-12 for float16), lse within 1e-3 (-inf exactly).
struct Outcome {
  std::vector<uint16_t> o;
  std::vector<float> lse;
  size_t unwritten = 0;
  double rel = 0.0, lse_err = 0.0;
  bool pass = false;
};
static Outcome read_and_compare(const Config& c, const Tensor4& o, const float* lse_dev, const Reference& ref) {
  Outcome got;
  const size_t rows = static_cast<size_t>(c.b) * c.h * c.sq;
  got.o.resize(o.host.size());
  got.lse.resize(rows);
  CHECK_CUDA(cudaMemcpy(got.o.data(), o.dev, got.o.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got.lse.data(), lse_dev, rows * 4, cudaMemcpyDeviceToHost));
  for (auto x : got.o) got.unwritten += std::isnan(to_float(x, c.fp16)) ? 1 : 0;
  double err = 0.0, norm = 0.0;
  for (size_t n = 0; n < ref.rows.size(); ++n) {
    const int r = ref.rows[n], bi = r / (c.h * c.sq), hi = (r / c.sq) % c.h, i = r % c.sq;
    for (int e = 0; e < c.d; ++e) {
      const double diff = to_float(got.o[o.at(bi, hi, i, e)], c.fp16) - ref.o[n][e];
      err += diff * diff;
      norm += ref.o[n][e] * ref.o[n][e];
    }
    const double l = got.lse[r];
    got.lse_err = std::max(got.lse_err, std::isinf(ref.lse[n]) ? (l == ref.lse[n] ? 0.0 : INFINITY)
                                                                : std::fabs(l - ref.lse[n]));
  }
  got.rel = norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
  got.pass = got.unwritten == 0 && got.rel < (c.fp16 ? 2e-3 : 1e-2) && got.lse_err < 1e-3;
  return got;
}

// Every rung on fresh random inputs; the output is NaN-poisoned first (an unwritten element fails).
// Rows checked against float64: all of them for small problems, else a random sample plus each
// tile's first and last rows. Returns false on a mismatch.
static bool check(const Config& c, std::mt19937& rng) {
  Tensor4 q(c.b, c.h, c.sq, c.d, c.bshd), k(c.b, c.hk, c.sk, c.d, c.bshd), v(c.b, c.hk, c.sk, c.d, c.bshd);
  Tensor4 o(c.b, c.h, c.sq, c.d, c.bshd);
  fill_random({&q, &k, &v}, rng, c.fp16);
  const size_t rows = static_cast<size_t>(c.b) * c.h * c.sq;
  float* lse_dev;
  CHECK_CUDA(cudaMalloc(&lse_dev, std::max<size_t>(rows, 1) * 4));
  const Reference ref = reference_rows(c, q, k, v, rng, 256);
  bool ok = true;
  for (auto rung : kRungs) {
    CHECK_CUDA(cudaMemset(o.dev, 0xFF, o.host.size() * 2));  // NaN in both 16-bit types
    CHECK_CUDA(cudaMemset(lse_dev, 0xFF, std::max<size_t>(rows, 1) * 4));
    const fa::AttentionParams p = make_params(c, q, k, v, o, lse_dev);
    CHECK_CUDA(fa::launch_attention_forward_hopper(p, rung, nullptr, workspace()));
    CHECK_CUDA(cudaDeviceSynchronize());
    const Outcome got = read_and_compare(c, o, lse_dev, ref);
    ok = ok && got.pass;
    std::printf("%-16s %s b%d h%d/%d sq%-5d sk%-5d d%-3d %s%s rel %.2e lse %.1e unwritten %zu %s\n", rung_name(rung),
                c.fp16 ? "fp16" : "bf16", c.b, c.h, c.hk, c.sq, c.sk, c.d, c.causal ? "causal " : "full   ",
                c.bshd ? "bshd" : "bhsd", got.rel, got.lse_err, got.unwritten, got.pass ? "ok" : "MISMATCH");
  }
  CHECK_CUDA(cudaFree(lse_dev));
  return ok;
}

static void time_config(const Config& c) {
  Tensor4 q(c.b, c.h, c.sq, c.d, c.bshd), k(c.b, c.hk, c.sk, c.d, c.bshd), v(c.b, c.hk, c.sk, c.d, c.bshd);
  Tensor4 o(c.b, c.h, c.sq, c.d, c.bshd);
  std::mt19937 rng(3);
  fill_random({&q, &k, &v}, rng, c.fp16);
  float* lse;
  CHECK_CUDA(cudaMalloc(&lse, static_cast<size_t>(c.b) * c.h * c.sq * 4));
  const fa::AttentionParams p = make_params(c, q, k, v, o, lse);
  double flops = 4.0 * c.b * c.h * static_cast<double>(c.sq) * c.sk * c.d;
  if (c.causal) flops /= 2;
  for (auto rung : kRungs) {
    const double ms = median_ms([&] { return fa::launch_attention_forward_hopper(p, rung, nullptr, workspace()); });
    std::printf("time %-16s b%d h%d/%d s%d d%d %s: %.3f ms %.1f TFLOP/s\n", rung_name(rung), c.b, c.h, c.hk, c.sq,
                c.d, c.causal ? "causal" : "full", ms, flops / (ms * 1e-3) / 1e12);
  }
  CHECK_CUDA(cudaFree(lse));
}

// ------------------------------------------------------------------------------------------
// --variants: configurations beside the rungs (key tile, stages, overlap, ping-pong), checked on a
// few shapes and timed; what the rungs' choices in flash_fwd_hopper_kernel.cuh were measured from.
// ------------------------------------------------------------------------------------------
using Launch = cudaError_t (*)(const fa::AttentionParams&, cudaStream_t);
struct Variant {
  const char* name;
  int d;
  Launch launch;
};
template <int D, int N, int S, bool kJoint, bool kPingpong, bool kOverlap = false, bool kPersistent = false,
          int kOStoreBytes = 16>
cudaError_t launch_variant(const fa::AttentionParams& p, cudaStream_t stream) {
  using K = fa::HopperFwdConfig<D, N, S, true, kJoint, kPingpong, kOverlap, kPersistent, kOStoreBytes>;
  if constexpr (kPersistent) {
    return fa::run_flash_fwd_hopper_persistent<__nv_bfloat16, K, false>(p, stream, workspace());
  } else {
    return fa::run_flash_fwd_hopper_config<__nv_bfloat16, K>(p, stream);
  }
}
static const Variant kVariants[] = {
    {"ws n128", 128, launch_variant<128, 128, 2, false, false>},
    {"ws n128 3st", 128, launch_variant<128, 128, 3, false, false>},
    {"joint n128", 128, launch_variant<128, 128, 2, true, false>},
    {"joint+pingpong n128", 128, launch_variant<128, 128, 2, true, true>},
    {"joint+pingpong n128 3st", 128, launch_variant<128, 128, 3, true, true>},
    // The overlap frees a stage a step later than the joint schedule: three stages (HopperFwdConfig).
    {"overlap+pingpong n128 3st", 128, launch_variant<128, 128, 3, false, true, true>},
    {"overlap n128 3st", 128, launch_variant<128, 128, 3, false, false, true>},
    {"ws n176", 128, launch_variant<128, 176, 2, false, false>},
    {"joint+pingpong n176", 128, launch_variant<128, 176, 2, true, true>},
    {"persistent joint+pingpong n128 3st", 128, launch_variant<128, 128, 3, true, true, false, true>},
    {"persistent ws n128 3st", 128, launch_variant<128, 128, 3, false, false, false, true>},
    // The epilogue's stores of O 4 and 8 bytes wide (HopperFwdConfig's kOStoreBytes; every other row
    // stores 16, as the rungs do): --compare checks them against the 16-byte row bit for bit and
    // times them side by side.
    {"persistent joint+pingpong n128 3st o4", 128, launch_variant<128, 128, 3, true, true, false, true, 4>},
    {"persistent joint+pingpong n128 3st o8", 128, launch_variant<128, 128, 3, true, true, false, true, 8>},
    {"ws n128", 64, launch_variant<64, 128, 2, false, false>},
    {"ws n128 3st", 64, launch_variant<64, 128, 3, false, false>},
    {"joint n128", 64, launch_variant<64, 128, 2, true, false>},
    {"joint+pingpong n128", 64, launch_variant<64, 128, 2, true, true>},
    {"joint+pingpong n128 3st", 64, launch_variant<64, 128, 3, true, true>},
    {"persistent joint+pingpong n128 3st", 64, launch_variant<64, 128, 3, true, true, false, true>},
    {"persistent joint+pingpong n128 3st o4", 64, launch_variant<64, 128, 3, true, true, false, true, 4>},
    // The extension's d = 64 rung (the overlap consumers), beside the joint ones.
    {"persistent overlap+pingpong n128 3st", 64, launch_variant<64, 128, 3, false, true, true, true>},
    {"ws n64", 256, launch_variant<256, 64, 2, false, false>},
    {"joint n64", 256, launch_variant<256, 64, 2, true, false>},
    {"joint+pingpong n64", 256, launch_variant<256, 64, 2, true, true>},
    {"persistent ws n64", 256, launch_variant<256, 64, 2, false, false, false, true>},
};

// Rows side by side on one shape: the inputs and their float64 reference (sampled rows) made once,
// each row launched into its own NaN-poisoned output and held to the reference; with `bits`, every
// row's o and lse also against the first row's, bit for bit (rows that only move the same words,
// such as the store widths: any difference is a bug). Then, if timed and all passed,
// every row in alternating rounds: kRounds rounds, each row 3 untimed and kReps timed calls a
// round, the order rotated so that each row leads some round; the median and the minimum of each
// row's timed calls. Making the inputs once matters: filling and referencing a 16M-element problem
// on the host takes seconds, the launches milliseconds.
struct RowResult {
  Outcome got;
  bool same_bits = true;
  double median_ms = 0.0, min_ms = 0.0;
  size_t reps = 0;
};
static std::vector<RowResult> run_rows(const std::vector<const Variant*>& rows, const Config& c, bool timed,
                                       bool bits) {
  Tensor4 q(c.b, c.h, c.sq, c.d, c.bshd), k(c.b, c.hk, c.sk, c.d, c.bshd), v(c.b, c.hk, c.sk, c.d, c.bshd);
  std::mt19937 rng(7);
  fill_random({&q, &k, &v}, rng, c.fp16);
  const size_t rows_total = std::max<size_t>(static_cast<size_t>(c.b) * c.h * c.sq, 1);
  const Reference ref = reference_rows(c, q, k, v, rng, 64);
  std::vector<RowResult> res(rows.size());
  std::vector<Tensor4*> outs;
  std::vector<float*> lses;
  std::vector<fa::AttentionParams> params;
  bool all_pass = true;
  for (size_t n = 0; n < rows.size(); ++n) {
    outs.push_back(new Tensor4(c.b, c.h, c.sq, c.d, c.bshd));
    float* lse;
    CHECK_CUDA(cudaMalloc(&lse, rows_total * 4));
    lses.push_back(lse);
    Tensor4& o = *outs.back();
    CHECK_CUDA(cudaMemset(o.dev, 0xFF, o.host.size() * 2));  // NaN: an unwritten element fails
    CHECK_CUDA(cudaMemset(lse, 0xFF, rows_total * 4));
    params.push_back(make_params(c, q, k, v, o, lse));
    CHECK_CUDA(rows[n]->launch(params.back(), nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    res[n].got = read_and_compare(c, o, lse, ref);
    if (bits && n > 0) {  // the output words as vectors, lse's floats as bits
      const Outcome& a = res[n].got;
      const Outcome& b = res[0].got;
      res[n].same_bits = a.o == b.o && std::equal(a.lse.begin(), a.lse.end(), b.lse.begin(), [](float x, float y) {
                           return std::memcmp(&x, &y, 4) == 0;
                         });
    }
    all_pass = all_pass && res[n].got.pass && res[n].same_bits;
  }
  if (timed && all_pass) {
    constexpr int kRounds = 5, kReps = 20;
    std::vector<std::vector<float>> times(rows.size());
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int round = 0; round < kRounds; ++round) {
      for (size_t j = 0; j < rows.size(); ++j) {
        const size_t n = (j + round) % rows.size();
        for (int i = 0; i < 3; ++i) CHECK_CUDA(rows[n]->launch(params[n], nullptr));
        for (int i = 0; i < kReps; ++i) {
          CHECK_CUDA(cudaEventRecord(start));
          CHECK_CUDA(rows[n]->launch(params[n], nullptr));
          CHECK_CUDA(cudaEventRecord(stop));
          CHECK_CUDA(cudaEventSynchronize(stop));
          float ms;
          CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          times[n].push_back(ms);
        }
      }
    }
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    for (size_t n = 0; n < rows.size(); ++n) {
      std::sort(times[n].begin(), times[n].end());
      res[n].median_ms = times[n][times[n].size() / 2];
      res[n].min_ms = times[n][0];
      res[n].reps = times[n].size();
    }
  }
  for (auto* o : outs) delete o;
  for (auto* l : lses) CHECK_CUDA(cudaFree(l));
  return res;
}

static double forward_flops(const Config& c) {
  return 4.0 * c.b * c.h * static_cast<double>(c.sq) * c.sk * c.d / (c.causal ? 2 : 1);
}

// The shapes every side-by-side comparison checks (untimed): rows past seqlen_q (17 of a tile's 128;
// the epilogue's shuffles run before the rows' guard), a partial last tile, causal, seqlen_q !=
// seqlen_k through (b, s, h, d) views and GQA.
static std::vector<Config> check_shapes(int d) {
  return {Config{1, 3, 3, 17, 17, d, false, false, false}, Config{1, 2, 1, 1000, 1000, d, true, false, false},
          Config{1, 2, 1, 129, 4097, d, false, true, false}};
}
// The shapes they are timed at, full and causal: a long walk, and, at d = 64 and 128, 512 keys
// (four key tiles an item: where a tile's prologue and epilogue weigh most; the sweep's shapes with
// 16384 tokens, 2048 wide).
static Config long_shape(int d, bool causal) {
  const int s = d == 64 ? 2048 : 8192, b = d == 64 ? 8 : 2, h = d == 256 ? 8 : 16;
  return {b, h, h, s, s, d, causal, false, false};
}
static std::vector<Config> timed_shapes(int d) {
  std::vector<Config> shapes;
  for (bool causal : {false, true}) {
    if (d == 128) shapes.push_back({32, 16, 16, 512, 512, 128, causal, false, false});
    if (d == 64) shapes.push_back({32, 32, 32, 512, 512, 64, causal, false, false});
    shapes.push_back(long_shape(d, causal));
  }
  return shapes;
}

// --variants: every configuration of a head dim side by side on its check and timed shapes. The
// "variant ..." lines are what bench_attention.py parses into the record.
static int run_variants() {
  bool ok = true;
  for (int d : {128, 64, 256}) {
    std::vector<const Variant*> rows;
    for (const Variant& var : kVariants) {
      if (var.d == d) rows.push_back(&var);
    }
    for (bool timed : {false, true}) {
      for (const Config& c : timed ? timed_shapes(d) : check_shapes(d)) {
        const std::vector<RowResult> res = run_rows(rows, c, timed, false);
        for (size_t n = 0; n < rows.size(); ++n) {
          const RowResult& r = res[n];
          ok = ok && r.got.pass;
          std::printf("variant %-26s d%-3d b%d h%d s%-5d/%-5d %s rel %.2e lse %.1e unwritten %zu %s", rows[n]->name, d,
                      c.b, c.h, c.sq, c.sk, c.causal ? "causal" : "full  ", r.got.rel, r.got.lse_err, r.got.unwritten,
                      r.got.pass ? "ok" : "MISMATCH");
          if (r.reps > 0) std::printf("  %.3f ms %.1f TFLOP/s", r.median_ms, forward_flops(c) / (r.median_ms * 1e-3) / 1e12);
          std::printf("\n");
        }
      }
    }
  }
  return ok ? 0 : 1;
}

// --compare BASE D [--quick]: the row named BASE beside every row named "BASE <suffix>" at head dim
// D, the rows that change how words are moved, not what is computed: " o4" / " o8" store O 4 and 8
// bytes wide (HopperFwdConfig's kOStoreBytes; every other row stores 16, as the rungs do). (A
// second Q buffer, " q2", was compared this way and taken out: NOTES.md.) Each is checked against
// float64 and against BASE bit for bit on the check shapes, then (not --quick) on the timed shapes,
// and timed there side by side. The "compare ..." lines are for a GPU script to parse.
static int run_compare(const std::string& base, int d, bool quick) {
  std::vector<const Variant*> rows;  // BASE first
  for (const Variant& var : kVariants) {
    if (var.d == d && var.name == base) rows.insert(rows.begin(), &var);
    else if (var.d == d && std::string(var.name).rfind(base + " ", 0) == 0) rows.push_back(&var);
  }
  if (rows.empty() || rows[0]->name != base) {
    std::printf("no variant %s at d%d\n", base.c_str(), d);
    return 1;
  }
  std::vector<Config> shapes = check_shapes(d);
  if (!quick) {
    for (const Config& c : timed_shapes(d)) shapes.push_back(c);
  }
  bool ok = true;
  for (size_t s = 0; s < shapes.size(); ++s) {
    const Config& c = shapes[s];
    const bool timed = s >= check_shapes(d).size();
    const std::vector<RowResult> res = run_rows(rows, c, timed, true);
    for (size_t n = 0; n < rows.size(); ++n) {
      const RowResult& r = res[n];
      const bool pass = r.got.pass && r.same_bits;
      ok = ok && pass;
      std::printf("compare check|%s|d%d|b%d h%d/%d sq%d sk%d %s %s|rel %.2e lse %.1e unwritten %zu bits %s|%s\n",
                  rows[n]->name, d, c.b, c.h, c.hk, c.sq, c.sk, c.causal ? "causal" : "full", c.bshd ? "bshd" : "bhsd",
                  r.got.rel, r.got.lse_err, r.got.unwritten, r.same_bits ? "same" : "DIFFERENT", pass ? "ok" : "MISMATCH");
    }
    for (size_t n = 0; n < rows.size() && timed; ++n) {
      const RowResult& r = res[n];
      if (r.reps == 0) continue;
      std::printf("compare time|%s|d%d|b%d h%d s%d %s|median_ms %.4f|min_ms %.4f|reps %zu|tflops %.1f\n",
                  rows[n]->name, d, c.b, c.h, c.sq, c.causal ? "causal" : "full", r.median_ms, r.min_ms, r.reps,
                  forward_flops(c) / (r.median_ms * 1e-3) / 1e12);
    }
  }
  std::printf(ok ? "compare: all checks passed\n" : "compare: SOME CHECKS FAILED\n");
  return ok ? 0 : 1;
}

// --profile NAME D: one launch of that variant at its long timed shape (full), for ncu.
static int profile_variant(const char* name, int d) {
  for (const Variant& var : kVariants) {
    if (std::string(var.name) == name && var.d == d) {
      return run_rows({&var}, long_shape(d, false), false, false)[0].got.pass ? 0 : 1;
    }
  }
  std::printf("no variant %s at d%d\n", name, d);
  return 1;
}

int main(int argc, char** argv) {
  int major = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) {
    std::printf("this program needs a Hopper GPU (compute capability 9.0)\n");
    return 0;
  }
  std::mt19937 rng(11);
  bool ok = true;
  if (argc > 1 && std::string(argv[1]) == "--variants") return run_variants();
  if (argc > 3 && std::string(argv[1]) == "--compare") {
    return run_compare(argv[2], std::atoi(argv[3]), argc > 4 && std::string(argv[4]) == "--quick");
  }
  if (argc > 3 && std::string(argv[1]) == "--profile") return profile_variant(argv[2], std::atoi(argv[3]));
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::vector<Config> configs;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (auto [sq, sk] : {std::pair{1, 1}, {17, 17}, {127, 127}, {128, 128}, {129, 129}, {1000, 1000},
                            {1, 1000}, {129, 4097}, {1000, 129}}) {
        configs.push_back({1, 2, 1, sq, sk, d, causal, false, false});
      }
    }
    configs.push_back({2, 4, 2, 4097, 4097, d, true, true, false});   // GQA, (b, s, h, d) views
    configs.push_back({2, 4, 4, 300, 300, d, false, false, true});    // float16
    configs.push_back({1, 3, 3, 0, 0, d, false, false, false});       // empty
  }
  for (const Config& c : configs) {
    if (quick && c.sq > 1000) continue;
    ok = check(c, rng) && ok;
  }
  std::printf(ok ? "all checks passed\n" : "SOME CHECKS FAILED\n");
  if (!ok) return 1;
  for (const Config& c : {Config{2, 16, 16, 8192, 8192, 128, false, false, false},
                          Config{2, 16, 16, 8192, 8192, 128, true, false, false},
                          Config{4, 32, 8, 4096, 4096, 128, true, false, false},
                          Config{8, 16, 16, 2048, 2048, 64, true, false, false},
                          Config{2, 16, 16, 8192, 8192, 64, false, false, false},
                          Config{2, 8, 8, 8192, 8192, 256, false, false, false}}) {
    time_config(c);
  }
  return 0;
}
