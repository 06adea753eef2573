// The CPU reference of attention, forward and backward: the semantics of attention.h in the
// plainest C++ that computes them, one query row at a time, on the same params as the CUDA
// launchers. It is what the GPU ladder is tested against on machines without a GPU, so it
// favours being obviously right over being fast: no tiling, no online softmax (chapter 3's
// trick is for the kernels, where a row of scores does not fit), serial.
//
// Torch-free (only header-only types from course/cpu_dtype.h), like every chapter's *_cpu.cpp
// that may one day sit behind the stable ABI. float32 inputs compute in float32 and float64 in
// float64 (course::CpuAcc): float32 accumulation is what the GPU kernels will do, so the CPU
// answer has the error profile a learner should expect from them, and float64 end to end keeps
// gradcheck's finite differences meaningful.
#include "attention/attention.h"

#include <course/cpu_dtype.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace flash_attention {
namespace {

using ::course::CpuAcc;
using ::course::with_cpu_type;

template <typename A, typename T, typename U>
A dot(const T* a, const U* b, int64_t n) {
  A sum = A(0);
  for (int64_t d = 0; d < n; ++d) sum += static_cast<A>(a[d]) * static_cast<A>(b[d]);
  return sum;
}

// Where a (batch, head, row) starts in a tensor described by its three outer strides.
template <typename T>
T* row_at(T* base, int64_t b, int64_t h, int64_t i, int64_t batch_stride, int64_t head_stride, int64_t seq_stride) {
  return base + b * batch_stride + h * head_stride + i * seq_stride;
}

// The score row i gives key j: scale * q . k, capped when softcap > 0 (attention.h). `t`, where
// not null, receives tanh(scale * q . k / softcap), which the backward's derivative needs.
template <typename A>
A score(A dot_qk, A scale, A softcap, A* t = nullptr) {
  const A s = scale * dot_qk;
  if (softcap <= A(0)) return s;
  const A th = std::tanh(s / softcap);
  if (t != nullptr) *t = th;
  return softcap * th;
}

template <typename T>
void forward(const AttentionParams& p) {
  using A = typename CpuAcc<T>::type;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t d = p.head_dim;
  const A scale = static_cast<A>(p.scale);
  const A softcap = static_cast<A>(p.softcap);
  std::vector<A> probs(static_cast<size_t>(p.seqlen_k));
  std::vector<A> acc(static_cast<size_t>(d));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t hk = h / group;
      A* lse = static_cast<A*>(p.lse) + (b * p.heads + h) * p.seqlen_q;
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        const T* q = row_at(static_cast<const T*>(p.q), b, h, i, p.q_batch_stride, p.q_head_stride, p.q_seq_stride);
        T* o = row_at(static_cast<T*>(p.o), b, h, i, p.o_batch_stride, p.o_head_stride, p.o_seq_stride);
        // Keys [j0, j1): the causal mask and the window (attention.h's key_begin and key_end).
        const int64_t j0 = key_begin(i, p), j1 = key_end(i, p);
        if (j0 == j1) {
          // the empty softmax: attention.h says why 0 and -inf
          for (int64_t c = 0; c < d; ++c) o[c] = T(0);
          lse[i] = -std::numeric_limits<A>::infinity();
          continue;
        }
        A row_max = -std::numeric_limits<A>::infinity();
        for (int64_t j = j0; j < j1; ++j) {
          const T* k = row_at(static_cast<const T*>(p.k), b, hk, j, p.k_batch_stride, p.k_head_stride, p.k_seq_stride);
          probs[j] = score(dot<A>(q, k, d), scale, softcap);
          row_max = std::max(row_max, probs[j]);
        }
        // Subtracting the row max keeps exp() in range whatever the scores are; the max is
        // added back into lse, so lse is the true log-sum-exp.
        A denom = A(0);
        for (int64_t j = j0; j < j1; ++j) {
          probs[j] = std::exp(probs[j] - row_max);
          denom += probs[j];
        }
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = j0; j < j1; ++j) {
          const T* v = row_at(static_cast<const T*>(p.v), b, hk, j, p.v_batch_stride, p.v_head_stride, p.v_seq_stride);
          for (int64_t c = 0; c < d; ++c) acc[c] += probs[j] * static_cast<A>(v[c]);
        }
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c] / denom);
        lse[i] = row_max + std::log(denom);
      }
    }
  }
}

// One kv head at a time: the query heads that share it add into one dk/dv accumulator, and no
// two kv heads touch the same memory, so a later parallel version can split over kv heads
// without atomics.
template <typename T>
void backward(const AttentionBackwardParams& g) {
  using A = typename CpuAcc<T>::type;
  const AttentionParams& p = g.fwd;
  const int64_t group = p.heads / p.heads_kv;
  const int64_t d = p.head_dim;
  const A scale = static_cast<A>(p.scale);
  const A softcap = static_cast<A>(p.softcap);
  std::vector<A> dk_acc(static_cast<size_t>(p.seqlen_k * d));
  std::vector<A> dv_acc(static_cast<size_t>(p.seqlen_k * d));
  std::vector<A> dq_acc(static_cast<size_t>(d));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
      std::fill(dk_acc.begin(), dk_acc.end(), A(0));
      std::fill(dv_acc.begin(), dv_acc.end(), A(0));
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const A* lse = static_cast<const A*>(p.lse) + (b * p.heads + h) * p.seqlen_q;
        for (int64_t i = 0; i < p.seqlen_q; ++i) {
          const T* q = row_at(static_cast<const T*>(p.q), b, h, i, p.q_batch_stride, p.q_head_stride, p.q_seq_stride);
          const T* o = row_at(static_cast<const T*>(p.o), b, h, i, p.o_batch_stride, p.o_head_stride, p.o_seq_stride);
          const T* dout = row_at(static_cast<const T*>(g.dout), b, h, i, g.do_batch_stride, g.do_head_stride,
                                 g.do_seq_stride);
          T* dq = row_at(static_cast<T*>(g.dq), b, h, i, g.dq_batch_stride, g.dq_head_stride, g.dq_seq_stride);
          const int64_t j0 = key_begin(i, p), j1 = key_end(i, p);
          if (j0 == j1) {
            // o is a constant 0 there: nothing flows back (and exp(s - lse) would be NaN)
            for (int64_t c = 0; c < d; ++c) dq[c] = T(0);
            continue;
          }
          const A delta = dot<A>(dout, o, d);
          std::fill(dq_acc.begin(), dq_acc.end(), A(0));
          for (int64_t j = j0; j < j1; ++j) {
            const T* k = row_at(static_cast<const T*>(p.k), b, hk, j, p.k_batch_stride, p.k_head_stride,
                                p.k_seq_stride);
            const T* v = row_at(static_cast<const T*>(p.v), b, hk, j, p.v_batch_stride, p.v_head_stride,
                                p.v_seq_stride);
            A t = A(0);
            const A prob = std::exp(score(dot<A>(q, k, d), scale, softcap, &t) - lse[i]);
            // dS with respect to the capped score, then through the cap: d(c tanh(s / c))/ds = 1 - tanh^2
            A dscore = prob * (dot<A>(dout, v, d) - delta);
            if (softcap > A(0)) dscore *= A(1) - t * t;
            A* dk_row = dk_acc.data() + j * d;
            A* dv_row = dv_acc.data() + j * d;
            for (int64_t c = 0; c < d; ++c) {
              dq_acc[c] += dscore * static_cast<A>(k[c]);
              dk_row[c] += dscore * static_cast<A>(q[c]);
              dv_row[c] += prob * static_cast<A>(dout[c]);
            }
          }
          for (int64_t c = 0; c < d; ++c) dq[c] = static_cast<T>(scale * dq_acc[c]);
        }
      }
      for (int64_t j = 0; j < p.seqlen_k; ++j) {
        T* dk = row_at(static_cast<T*>(g.dk), b, hk, j, g.dk_batch_stride, g.dk_head_stride, g.dk_seq_stride);
        T* dv = row_at(static_cast<T*>(g.dv), b, hk, j, g.dv_batch_stride, g.dv_head_stride, g.dv_seq_stride);
        for (int64_t c = 0; c < d; ++c) {
          dk[c] = static_cast<T>(scale * dk_acc[j * d + c]);
          dv[c] = static_cast<T>(dv_acc[j * d + c]);
        }
      }
    }
  }
}

}  // namespace

void attention_forward_cpu(const AttentionParams& p) {
  with_cpu_type(p.dtype, [&](auto tag) { forward<decltype(tag)>(p); });
}

void attention_backward_cpu(const AttentionBackwardParams& p) {
  with_cpu_type(p.fwd.dtype, [&](auto tag) { backward<decltype(tag)>(p); });
}

}  // namespace flash_attention
