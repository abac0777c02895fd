// CPU kernels for the LM head's softmax over the vocabulary (flowkit::logprob_entropy[_backward_]).
// One row of logits (a token's vocabulary) stays in cache while it is read: the forward makes one pass for the
// maximum and one for Σ e^y and Σ e^y·y (y = (z − max)/T), the backward one read-write pass in place, where the
// PyTorch reference makes about eight passes and allocates four vocabulary-sized tensors per chunk.
// Parallel over rows with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "../fast_exp.h"
#include "../simd_clones.h"

namespace flowkit {
namespace {

FLOWKIT_SIMD_CLONES float row_max(const float* z, int64_t vocab) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t v = 0; v < vocab; ++v) top = z[v] > top ? z[v] : top;
  return top;
}

// Σ e^y and Σ e^y·y over y = (z − top)·inv_t.
FLOWKIT_SIMD_CLONES void row_sums(const float* z, int64_t vocab, float top, float inv_t, float* sum, float* moment) {
  float s = 0.0f, m = 0.0f;
#pragma omp simd reduction(+ : s, m)
  for (int64_t v = 0; v < vocab; ++v) {
    const float y = (z[v] - top) * inv_t;
    const float e = exp_nonpositive(y);
    s += e;
    m += e > 0.0f ? e * y : 0.0f;  // a −inf logit adds 0, not 0·(−inf)
  }
  *sum = s;
  *moment = m;
}

// z ← ∂/∂z of g_p·log p(target) + g_H·H, without the target's one-hot term: −(g_p + g_H·(log p + H))·p/T.
FLOWKIT_SIMD_CLONES void row_gradient(float* z, int64_t vocab, float inv_t, float lse, float entropy, float coef_p,
                                      float coef_h) {
#pragma omp simd
  for (int64_t v = 0; v < vocab; ++v) {
    const float log_p = z[v] * inv_t - lse;
    const float p = exp_nonpositive(log_p);
    z[v] = p > 0.0f ? -(coef_p + coef_h * (log_p + entropy)) * p : 0.0f;  // a −inf logit: p = 0, gradient 0
  }
}

void check_rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 (N, V)");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong,
              "targets must be int64 (N,)");
}

void check_targets(const at::Tensor& targets, int64_t vocab) {
  const int64_t* t_ptr = targets.data_ptr<int64_t>();
  for (int64_t n = 0; n < targets.numel(); ++n)
    TORCH_CHECK(0 <= t_ptr[n] && t_ptr[n] < vocab, "target ", t_ptr[n], " outside the vocabulary of ", vocab);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_entropy_cpu(const at::Tensor& logits,
                                                                   const at::Tensor& targets_in, double temperature) {
  check_rows(logits, targets_in);
  const at::Tensor targets = targets_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && temperature > 0.0, "need a vocabulary and a positive temperature");
  check_targets(targets, vocab);
  at::Tensor logprob = at::empty({rows}, logits.options());
  at::Tensor entropy = at::empty({rows}, logits.options());
  at::Tensor log_normalizer = at::empty({rows}, logits.options());
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* z_ptr = logits.data_ptr<float>();
  const int64_t* t_ptr = targets.data_ptr<int64_t>();
  float *lp_ptr = logprob.data_ptr<float>(), *h_ptr = entropy.data_ptr<float>();
  float* lse_ptr = log_normalizer.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* z = z_ptr + n * vocab;
      const float top = row_max(z, vocab);
      float sum, moment;
      row_sums(z, vocab, top, inv_t, &sum, &moment);
      const float log_sum = std::log(sum);
      lse_ptr[n] = top * inv_t + log_sum;
      h_ptr[n] = log_sum - moment / sum;
      lp_ptr[n] = z[t_ptr[n]] * inv_t - lse_ptr[n];
    }
  });
  return {logprob, entropy, log_normalizer};
}

void logprob_entropy_backward_cpu(const at::Tensor& logits, const at::Tensor& targets_in,
                                  const at::Tensor& log_normalizer_in,
                                  const at::Tensor& entropy_in, const at::Tensor& grad_logprob_in,
                                  const std::optional<at::Tensor>& grad_entropy_in, double temperature) {
  check_rows(logits, targets_in);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const at::Tensor* row_values : {&log_normalizer_in, &entropy_in, &grad_logprob_in})
    TORCH_CHECK(row_values->numel() == rows && row_values->scalar_type() == at::kFloat,
                "row values must be float32 (N,)");
  const bool has_grad_entropy = grad_entropy_in.has_value() && grad_entropy_in->defined();
  TORCH_CHECK(!has_grad_entropy || grad_entropy_in->numel() == rows, "grad_entropy must be (N,)");
  TORCH_CHECK(temperature > 0.0, "need a positive temperature");
  const at::Tensor targets = targets_in.contiguous(), lse = log_normalizer_in.contiguous();
  check_targets(targets, vocab);
  const at::Tensor entropy = entropy_in.contiguous(), grad_logprob = grad_logprob_in.contiguous();
  const at::Tensor grad_entropy = has_grad_entropy ? grad_entropy_in->to(at::kFloat).contiguous() : at::Tensor();
  const float inv_t = static_cast<float>(1.0 / temperature);
  float* z_ptr = logits.data_ptr<float>();
  const int64_t* t_ptr = targets.data_ptr<int64_t>();
  const float *lse_ptr = lse.data_ptr<float>(), *h_ptr = entropy.data_ptr<float>();
  const float* gp_ptr = grad_logprob.data_ptr<float>();
  const float* gh_ptr = has_grad_entropy ? grad_entropy.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* z = z_ptr + n * vocab;
      const float coef_p = gp_ptr[n] * inv_t, coef_h = gh_ptr ? gh_ptr[n] * inv_t : 0.0f;
      row_gradient(z, vocab, inv_t, lse_ptr[n], h_ptr[n], coef_p, coef_h);
      z[t_ptr[n]] += coef_p;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("logprob_entropy", &logprob_entropy_cpu);
  m.impl("logprob_entropy_backward_", &logprob_entropy_backward_cpu);
}

}  // namespace flowkit
