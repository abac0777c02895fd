// CPU kernels for RMSNorm over the last dimension (flowkit::rms_norm[_backward]): y = w · x / rms(x), one row in
// cache at a time. The forward returns each row's 1/rms for the backward, which makes one pass per row for both
// gradients (the weight's summed over rows per thread, then over threads), where PyTorch's pow, mean, rsqrt and mul
// and their backwards make about a dozen passes over the M × d activations.
// Parallel over rows with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "../simd_clones.h"

namespace flowkit {
namespace {

// y = w · (x · r), r = 1/sqrt(mean(x²) + eps); returns r.
FLOWKIT_SIMD_CLONES float rms_norm_row(const float* x, const float* w, float* y, int64_t dim, float eps) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < dim; ++d) squares += x[d] * x[d];
  const float r = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] = w[d] * (x[d] * r);
  return r;
}

// dx = r · (w·g − x̂ · mean(w·g·x̂)), x̂ = x·r; dw += g·x̂.
FLOWKIT_SIMD_CLONES void rms_norm_backward_row(const float* g, const float* x, const float* w, float r, float* dx,
                                               float* dw, int64_t dim) {
  float projection = 0.0f;
#pragma omp simd reduction(+ : projection)
  for (int64_t d = 0; d < dim; ++d) projection += w[d] * g[d] * x[d] * r;
  const float mean = projection / static_cast<float>(dim);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    const float normed = x[d] * r;
    dx[d] = r * (w[d] * g[d] - normed * mean);
    dw[d] += g[d] * normed;
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.is_contiguous() && x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm takes contiguous float32 x (..., d) and weight (d)");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs(x, weight);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  at::Tensor y = at::empty_like(x);
  std::vector<int64_t> row_shape = x.sizes().vec();
  row_shape.pop_back();
  at::Tensor inverse_rms = at::empty(row_shape, x.options());
  const float *x_ptr = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *y_ptr = y.data_ptr<float>(), *r_ptr = inverse_rms.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      r_ptr[n] = rms_norm_row(x_ptr + n * dim, w, y_ptr + n * dim, dim, static_cast<float>(eps));
  });
  return {y, inverse_rms};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_in, const at::Tensor& x,
                                                         const at::Tensor& weight, const at::Tensor& inverse_rms) {
  check_inputs(x, weight);
  const at::Tensor grad = grad_in.contiguous();
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == at::kFloat, "grad must be float32 of x's shape");
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  TORCH_CHECK(inverse_rms.numel() == rows && inverse_rms.is_contiguous(), "inverse_rms must be x's shape but the last");
  at::Tensor grad_x = at::empty_like(x);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  std::vector<float> partial(chunks * dim, 0.0f);  // each chunk's share of the weight's gradient
  const float *g = grad.data_ptr<float>(), *x_ptr = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* r = inverse_rms.data_ptr<float>();
  float* dx = grad_x.data_ptr<float>();
  const int64_t per_chunk = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t n = c * per_chunk; n < std::min(rows, (c + 1) * per_chunk); ++n)
        rms_norm_backward_row(g + n * dim, x_ptr + n * dim, w, r[n], dx + n * dim, partial.data() + c * dim, dim);
  });
  at::Tensor grad_weight = at::zeros({dim}, weight.options());
  float* dw = grad_weight.data_ptr<float>();
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t d = 0; d < dim; ++d) dw[d] += partial[c * dim + d];
  return {grad_x, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace flowkit
