// CPU kernels for flowkit::flow_attention[_backward]: each flow query (RoPE already applied) attends over the
// cached context keys [0, prefix_len) of its example plus the F flow keys of its evaluation, with GQA.
// One task per (b, s, kv head) handles its F·G query rows, so the flow keys' gradients need no cross-task
// reduction and no (B, S, F, H, N) score tensor is materialised.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flow_attention_inputs.h"

namespace flowkit {
namespace {

using Dims = FlowAttentionDims;

template <typename acc_t, typename scalar_t>
inline acc_t dot(const acc_t* a, const scalar_t* b, int64_t n) {
  acc_t sum = acc_t(0);
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * static_cast<acc_t>(b[i]);
  return sum;
}

// y += a·x
template <typename acc_t, typename scalar_t>
inline void axpy(acc_t a, const scalar_t* x, acc_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<acc_t>(x[i]);
}

// Calls fn(j, key_row, value_row) for every visible key j of task (b, s, kvh).
template <typename scalar_t, typename Fn>
inline void for_each_key(const Dims& d, const scalar_t* ck, const scalar_t* cv, const scalar_t* fk, const scalar_t* fv,
                         int64_t b, int64_t s, int64_t kvh, int64_t len, Fn fn) {
  const int64_t ctx_base = (b * d.kv_heads + kvh) * d.context * d.head_dim;
  for (int64_t n = 0; n < len; ++n) fn(n, ck + ctx_base + n * d.head_dim, cv + ctx_base + n * d.head_dim);
  for (int64_t f = 0; f < d.flow; ++f) {
    const int64_t off = (((b * d.steps + s) * d.flow + f) * d.kv_heads + kvh) * d.head_dim;
    fn(len + f, fk + off, fv + off);
  }
}

std::tuple<at::Tensor, at::Tensor> flow_attention_cpu(const at::Tensor& q_in, const at::Tensor& fk_in,
                                                      const at::Tensor& fv_in, const at::Tensor& ck_in,
                                                      const at::Tensor& cv_in, const at::Tensor& lens_in) {
  const Dims d = check_flow_attention_inputs(q_in, fk_in, fv_in, ck_in, cv_in, lens_in);
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({d.batch, d.steps, d.flow, d.heads},
                             q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *q_ptr = q.data_ptr<scalar_t>(), *fk_ptr = fk.data_ptr<scalar_t>(), *fv_ptr = fv.data_ptr<scalar_t>();
    const scalar_t *ck_ptr = ck.data_ptr<scalar_t>(), *cv_ptr = cv.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    acc_t* lse_ptr = lse.data_ptr<acc_t>();
    const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(d.head_dim));
    at::parallel_for(0, d.batch * d.steps * d.kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> query(d.head_dim), acc(d.head_dim), scores(d.context + d.flow);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kvh = task % d.kv_heads, s = (task / d.kv_heads) % d.steps, b = task / (d.kv_heads * d.steps);
        const int64_t len = std::clamp<int64_t>(len_ptr[b * d.steps + s], 0, d.context);
        for (int64_t f = 0; f < d.flow; ++f) {
          for (int64_t g = 0; g < d.group; ++g) {
            const int64_t h = kvh * d.group + g;
            const int64_t row = ((b * d.steps + s) * d.flow + f) * d.heads + h;
            for (int64_t i = 0; i < d.head_dim; ++i) query[i] = static_cast<acc_t>(q_ptr[row * d.head_dim + i]) * scale;
            acc_t max_score = -std::numeric_limits<acc_t>::infinity();
            for_each_key(d, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh, len, [&](int64_t j, const scalar_t* k, const scalar_t*) {
              scores[j] = dot(query.data(), k, d.head_dim);
              max_score = std::max(max_score, scores[j]);
            });
            std::fill(acc.begin(), acc.end(), acc_t(0));
            acc_t total = acc_t(0);
            for_each_key(d, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh, len, [&](int64_t j, const scalar_t*, const scalar_t* v) {
              const acc_t p = std::exp(scores[j] - max_score);
              total += p;
              axpy(p, v, acc.data(), d.head_dim);
            });
            for (int64_t i = 0; i < d.head_dim; ++i) out_ptr[row * d.head_dim + i] = static_cast<scalar_t>(acc[i] / total);
            lse_ptr[row] = max_score + std::log(total);
          }
        }
      }
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flow_attention_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& fk_in, const at::Tensor& fv_in,
    const at::Tensor& ck_in, const at::Tensor& cv_in, const at::Tensor& lens_in, const at::Tensor& out_in,
    const at::Tensor& lse_in) {
  const Dims d = check_flow_attention_inputs(q_in, fk_in, fv_in, ck_in, cv_in, lens_in);
  check_flow_attention_backward_inputs(q_in, grad_in, out_in, lse_in);
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  const at::Tensor grad = grad_in.contiguous().to(q.scalar_type()), out = out_in.contiguous(), lse = lse_in.contiguous();
  at::Tensor grad_q = at::empty_like(q), grad_fk = at::empty_like(fk), grad_fv = at::empty_like(fv);
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *q_ptr = q.data_ptr<scalar_t>(), *fk_ptr = fk.data_ptr<scalar_t>(), *fv_ptr = fv.data_ptr<scalar_t>();
    const scalar_t *ck_ptr = ck.data_ptr<scalar_t>(), *cv_ptr = cv.data_ptr<scalar_t>();
    const scalar_t *g_ptr = grad.data_ptr<scalar_t>(), *o_ptr = out.data_ptr<scalar_t>();
    const acc_t* lse_ptr = lse.data_ptr<acc_t>();
    scalar_t *gq_ptr = grad_q.data_ptr<scalar_t>(), *gfk_ptr = grad_fk.data_ptr<scalar_t>(), *gfv_ptr = grad_fv.data_ptr<scalar_t>();
    const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(d.head_dim));
    at::parallel_for(0, d.batch * d.steps * d.kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> query(d.head_dim), grad_out(d.head_dim), dq(d.head_dim);
      std::vector<acc_t> dk(d.flow * d.head_dim), dv(d.flow * d.head_dim);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kvh = task % d.kv_heads, s = (task / d.kv_heads) % d.steps, b = task / (d.kv_heads * d.steps);
        const int64_t len = std::clamp<int64_t>(len_ptr[b * d.steps + s], 0, d.context);
        std::fill(dk.begin(), dk.end(), acc_t(0));
        std::fill(dv.begin(), dv.end(), acc_t(0));
        for (int64_t f = 0; f < d.flow; ++f) {
          for (int64_t g = 0; g < d.group; ++g) {
            const int64_t row = ((b * d.steps + s) * d.flow + f) * d.heads + kvh * d.group + g;
            acc_t delta = acc_t(0);  // rowsum(dO ⊙ O)
            for (int64_t i = 0; i < d.head_dim; ++i) {
              query[i] = static_cast<acc_t>(q_ptr[row * d.head_dim + i]);
              grad_out[i] = static_cast<acc_t>(g_ptr[row * d.head_dim + i]);
              delta += grad_out[i] * static_cast<acc_t>(o_ptr[row * d.head_dim + i]);
            }
            std::fill(dq.begin(), dq.end(), acc_t(0));
            const acc_t row_lse = lse_ptr[row];
            for_each_key(d, ck_ptr, cv_ptr, fk_ptr, fv_ptr, b, s, kvh, len, [&](int64_t j, const scalar_t* k, const scalar_t* v) {
              const acc_t p = std::exp(dot(query.data(), k, d.head_dim) * scale - row_lse);
              const acc_t ds = p * (dot(grad_out.data(), v, d.head_dim) - delta) * scale;
              axpy(ds, k, dq.data(), d.head_dim);
              if (j >= len) {  // flow key: its K and V receive gradient
                acc_t* dk_row = dk.data() + (j - len) * d.head_dim;
                acc_t* dv_row = dv.data() + (j - len) * d.head_dim;
                for (int64_t i = 0; i < d.head_dim; ++i) {
                  dk_row[i] += ds * query[i];
                  dv_row[i] += p * grad_out[i];
                }
              }
            });
            for (int64_t i = 0; i < d.head_dim; ++i) gq_ptr[row * d.head_dim + i] = static_cast<scalar_t>(dq[i]);
          }
        }
        for (int64_t f = 0; f < d.flow; ++f) {
          const int64_t off = (((b * d.steps + s) * d.flow + f) * d.kv_heads + kvh) * d.head_dim;
          for (int64_t i = 0; i < d.head_dim; ++i) {
            gfk_ptr[off + i] = static_cast<scalar_t>(dk[f * d.head_dim + i]);
            gfv_ptr[off + i] = static_cast<scalar_t>(dv[f * d.head_dim + i]);
          }
        }
      }
    });
  });
  return {grad_q, grad_fk, grad_fv};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("flow_attention", &flow_attention_cpu);
  m.impl("flow_attention_backward", &flow_attention_backward_cpu);
}

}  // namespace flowkit
