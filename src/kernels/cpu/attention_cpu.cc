// CPU reference attention: one task per (batch, head) in the forward and per (batch, kv head) in the backward (so
// that grad_k and grad_v of a kv head are summed by one thread), numerically stable softmax, math in acc_t (f32 for
// 16-bit inputs).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention_kernel.h"
#include "kernels/primitives/cpu_loops.h"

namespace loom {
namespace {

template <typename T, typename A>
void widen_into(const T* src, int64_t n, A* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = A(src[i]);
}

template <typename A>
A dot(const A* a, const A* b, int64_t n) {
  A s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct AttentionDims {
  int64_t batch, heads, kv_heads, q_len, kv_len, head_dim;
  int64_t group() const { return heads / kv_heads; }
  // Keys query t may see.
  int64_t visible(int64_t t, bool causal) const { return causal ? std::min(kv_len, t + kv_len - q_len + 1) : kv_len; }
};

AttentionDims dims_of(const Tensor& q, const Tensor& k) {
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

template <typename T>
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& attrs, Tensor& out,
                       Tensor& lse) {
  using A = acc_t<T>;
  const AttentionDims n = dims_of(q, k);
  const int64_t D = n.head_dim, S = n.kv_len, kv_size = S * D;
  const T* qp = static_cast<const T*>(q.data());
  const T* kp = static_cast<const T*>(k.data());
  const T* vp = static_cast<const T*>(v.data());
  T* op = static_cast<T*>(out.data());
  A* lp = static_cast<A*>(lse.data());
  const A scale = A(attrs.scale);
  cpu::parallel_for(n.batch * n.heads, 1, [&](int64_t begin, int64_t end) {
    const size_t kv_elems = size_t(kv_size), row_elems = size_t(D), score_elems = size_t(S);
    std::vector<A> keys(kv_elems), values(kv_elems), query(row_elems), acc(row_elems), scores(score_elems);
    int64_t loaded = -1;
    for (int64_t bh = begin; bh < end; ++bh) {
      int64_t kv_index = (bh / n.heads) * n.kv_heads + (bh % n.heads) / n.group();
      if (kv_index != loaded) {
        widen_into(kp + kv_index * kv_size, kv_size, keys.data());
        widen_into(vp + kv_index * kv_size, kv_size, values.data());
        loaded = kv_index;
      }
      for (int64_t t = 0; t < n.q_len; ++t) {
        int64_t row = bh * n.q_len + t;
        widen_into(qp + row * D, D, query.data());
        int64_t visible = n.visible(t, attrs.causal);
        A max_score = -std::numeric_limits<A>::infinity();
        for (int64_t s = 0; s < visible; ++s) {
          scores[size_t(s)] = scale * dot(query.data(), keys.data() + s * D, D);
          max_score = std::max(max_score, scores[size_t(s)]);
        }
        std::fill(acc.begin(), acc.end(), A(0));
        A denominator = 0;
        for (int64_t s = 0; s < visible; ++s) {
          A p = std::exp(scores[size_t(s)] - max_score);
          denominator += p;
          const A* value = values.data() + s * D;
          for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += p * value[d];
        }
        for (int64_t d = 0; d < D; ++d) op[row * D + d] = T(acc[size_t(d)] / denominator);
        lp[row] = max_score + std::log(denominator);
      }
    }
  });
}

template <typename T>
void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const AttentionAttrs& attrs, Tensor& grad_q, Tensor& grad_k,
                        Tensor& grad_v) {
  using A = acc_t<T>;
  const AttentionDims n = dims_of(q, k);
  const int64_t D = n.head_dim, S = n.kv_len, kv_size = S * D;
  const T* gop = static_cast<const T*>(grad_out.data());
  const T* qp = static_cast<const T*>(q.data());
  const T* kp = static_cast<const T*>(k.data());
  const T* vp = static_cast<const T*>(v.data());
  const T* op = static_cast<const T*>(out.data());
  const A* lp = static_cast<const A*>(lse.data());
  T* gq = static_cast<T*>(grad_q.data());
  T* gk = static_cast<T*>(grad_k.data());
  T* gv = static_cast<T*>(grad_v.data());
  const A scale = A(attrs.scale);
  cpu::parallel_for(n.batch * n.kv_heads, 1, [&](int64_t begin, int64_t end) {
    const size_t kv_elems = size_t(kv_size), row_elems = size_t(D);
    std::vector<A> keys(kv_elems), values(kv_elems), dk(kv_elems), dv(kv_elems);
    std::vector<A> query(row_elems), grad_row(row_elems), out_row(row_elems), dq(row_elems);
    for (int64_t bkv = begin; bkv < end; ++bkv) {
      widen_into(kp + bkv * kv_size, kv_size, keys.data());
      widen_into(vp + bkv * kv_size, kv_size, values.data());
      std::fill(dk.begin(), dk.end(), A(0));
      std::fill(dv.begin(), dv.end(), A(0));
      int64_t b = bkv / n.kv_heads, kv_head = bkv % n.kv_heads;
      for (int64_t h = kv_head * n.group(); h < (kv_head + 1) * n.group(); ++h) {
        for (int64_t t = 0; t < n.q_len; ++t) {
          int64_t row = (b * n.heads + h) * n.q_len + t;
          widen_into(qp + row * D, D, query.data());
          widen_into(gop + row * D, D, grad_row.data());
          widen_into(op + row * D, D, out_row.data());
          // sum_s P_s dP_s = grad_out . out, the softmax backward's row term.
          A row_term = dot(grad_row.data(), out_row.data(), D);
          A row_lse = lp[row];
          std::fill(dq.begin(), dq.end(), A(0));
          int64_t visible = n.visible(t, attrs.causal);
          for (int64_t s = 0; s < visible; ++s) {
            const A* key = keys.data() + s * D;
            A p = std::exp(scale * dot(query.data(), key, D) - row_lse);
            A dp = dot(grad_row.data(), values.data() + s * D, D);
            A ds = p * (dp - row_term);
            A* dk_row = dk.data() + s * D;
            A* dv_row = dv.data() + s * D;
            for (int64_t d = 0; d < D; ++d) {
              dv_row[d] += p * grad_row[size_t(d)];
              dq[size_t(d)] += ds * key[d];
              dk_row[d] += ds * query[size_t(d)];
            }
          }
          for (int64_t d = 0; d < D; ++d) gq[row * D + d] = T(scale * dq[size_t(d)]);
        }
      }
      for (int64_t i = 0; i < kv_size; ++i) {
        gk[bkv * kv_size + i] = T(scale * dk[size_t(i)]);
        gv[bkv * kv_size + i] = T(dv[size_t(i)]);
      }
    }
  });
}

void attention_forward_cpu(const DeviceContext&, const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttentionAttrs& attrs, Tensor& out, Tensor& lse) {
  LOOM_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention",
                         [&] { attention_forward<scalar_t>(q, k, v, attrs, out, lse); });
}

void attention_backward_cpu(const DeviceContext&, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                            Tensor& grad_q, Tensor& grad_k, Tensor& grad_v) {
  LOOM_DISPATCH_FLOATING(q.dtype(), "scaled_dot_product_attention_backward", [&] {
    attention_backward<scalar_t>(grad_out, q, k, v, out, lse, attrs, grad_q, grad_k, grad_v);
  });
}

}  // namespace

LOOM_REGISTER_KERNEL(scaled_dot_product_attention, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     attention_forward_cpu);
LOOM_REGISTER_KERNEL(scaled_dot_product_attention_backward, kCPU, "native", dtypes(kF32, kF64, kF16, kBF16),
                     attention_backward_cpu);

}  // namespace loom
