// CPU kernel for rotary position embeddings (flowkit::rotary): out = x·cos + rotate_half(x)·sin for each head of
// each row, rotate_half(x) = (−x[d/2:], x[:d/2]), in one pass instead of PyTorch's seven (two products, a negation,
// two slices, a concatenation and a sum). Each product and the sum are rounded as PyTorch rounds them (no fused
// multiply-add), so the result is PyTorch's to the bit. Parallel over rows with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "../simd_clones.h"

namespace flowkit {
namespace {

// One row's heads: x and out (heads × dim), cos and sin (dim). fp-contract off: a fused multiply-add would round
// x·cos + r·sin once instead of three times, and differ from PyTorch's ops in the last bit.
__attribute__((optimize("fp-contract=off"))) FLOWKIT_SIMD_CLONES void rotate_row(
    const float* x, const float* cos, const float* sin, float* out, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h, x += dim, out += dim) {
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float direct = x[d] * cos[d], turned = -x[d + half] * sin[d];
      out[d] = direct + turned;
    }
#pragma omp simd
    for (int64_t d = half; d < dim; ++d) {
      const float direct = x[d] * cos[d], turned = x[d - half] * sin[d];
      out[d] = direct + turned;
    }
  }
}

at::Tensor rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary takes float32 tensors");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.size(2) % 2 == 0, "x must be contiguous (rows, heads, even dim)");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous (rows, dim) of x's rows and dim");
  at::Tensor out = at::empty_like(x);
  const int64_t heads = x.size(1), dim = x.size(2);
  const float *x_ptr = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      rotate_row(x_ptr + row * heads * dim, c + row * dim, s + row * dim, o + row * heads * dim, heads, dim);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) { m.impl("rotary", &rotary_cpu); }

}  // namespace flowkit
