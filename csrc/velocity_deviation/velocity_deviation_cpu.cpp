// CPU kernels for the RLFR prologue / epilogue (flowkit::interpolate_latents, velocity_deviation[_backward]).
// Rows of the stacked batch are (p, t, n), p slowest; ε at (p, t, n, j) is noise_at(seed,
// deviation_noise_base(token_offset + n, P·T, p·T + t, d) + j), so the P·T·N·d noise tensor is never stored.
// Parallel over tokens / rows with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../flow_noise.h"
#include "../simd_clones.h"

namespace flowkit {
namespace {

// ε for counters base .. base + d − 1 into eps (branch-free, so the loop vectorises).
FLOWKIT_SIMD_CLONES void fill_noise(NoiseKeys keys, uint64_t base, int64_t d, float* eps) {
  for (int64_t j = 0; j < d; ++j) eps[j] = noise_at(keys, base + static_cast<uint64_t>(j));
}

// Σ_j (v_j − (x1_j − ε_j))² (a helper so the simd pragma is not inside the dispatch macro).
template <typename acc_t, typename scalar_t>
acc_t squared_deviation(const scalar_t* v, const scalar_t* x1, const float* eps, int64_t d) {
  acc_t acc = acc_t(0);
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < d; ++j) {
    const acc_t diff = static_cast<acc_t>(v[j]) - static_cast<acc_t>(x1[j]) + static_cast<acc_t>(eps[j]);
    acc += diff * diff;
  }
  return acc;
}

struct Shapes {
  int64_t layers, steps, tokens, dim;
};

Shapes check_inputs(const at::Tensor& x1, const at::Tensor& timesteps) {
  TORCH_CHECK(x1.dim() == 3, "x1 must be (P, N, d)");
  TORCH_CHECK(timesteps.dim() == 1 && timesteps.scalar_type() == at::kFloat, "timesteps must be a float32 vector");
  return Shapes{x1.size(0), timesteps.size(0), x1.size(1), x1.size(2)};
}

void check_stacked(const at::Tensor& v, const at::Tensor& x1, const Shapes& s, const at::Tensor& weights,
                   const at::Tensor& mask) {
  TORCH_CHECK(v.dim() == 2 && v.size(0) == s.layers * s.steps * s.tokens && v.size(1) == s.dim,
              "v must be (P*T*N, d)");
  TORCH_CHECK(v.scalar_type() == x1.scalar_type(), "v and x1 must share a dtype");
  TORCH_CHECK(weights.numel() == s.steps && weights.scalar_type() == at::kFloat, "weights must be float32 (T,)");
  TORCH_CHECK(mask.numel() == s.tokens && mask.scalar_type() == at::kFloat, "mask must be float32 (N,)");
}

at::Tensor interpolate_latents_cpu(const at::Tensor& x1_in, const at::Tensor& timesteps_in, int64_t seed,
                                  int64_t token_offset) {
  const Shapes s = check_inputs(x1_in, timesteps_in);
  const at::Tensor x1 = x1_in.contiguous();
  const at::Tensor timesteps = timesteps_in.contiguous();
  at::Tensor out = at::empty({s.layers * s.steps * s.tokens, s.dim}, x1.options());
  const NoiseKeys keys = noise_keys(seed);
  const float* t_ptr = timesteps.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "interpolate_latents_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x1_ptr = x1.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, s.layers * s.steps * s.tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> eps(s.dim);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row % s.tokens, pt = row / s.tokens, p = pt / s.steps;
        const acc_t t = static_cast<acc_t>(t_ptr[pt % s.steps]);
        fill_noise(keys, deviation_noise_base(token_offset + n, s.layers * s.steps, pt, s.dim), s.dim, eps.data());
        const scalar_t* x = x1_ptr + (p * s.tokens + n) * s.dim;
        scalar_t* o = out_ptr + row * s.dim;
        for (int64_t j = 0; j < s.dim; ++j)
          o[j] = static_cast<scalar_t>(t * static_cast<acc_t>(x[j]) + (acc_t(1) - t) * static_cast<acc_t>(eps[j]));
      }
    });
  });
  return out;
}

at::Tensor velocity_deviation_cpu(const at::Tensor& v_in, const at::Tensor& x1_in, const at::Tensor& timesteps_in,
                                  const at::Tensor& weights_in, int64_t seed, int64_t token_offset,
                                  const at::Tensor& mask_in) {
  const Shapes s = check_inputs(x1_in, timesteps_in);
  check_stacked(v_in, x1_in, s, weights_in, mask_in);
  const at::Tensor v = v_in.contiguous(), x1 = x1_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  // scores accumulate in the op-math type: float32, or float64 for float64 inputs
  at::Tensor score = at::empty({s.tokens}, x1.options().dtype(v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  const NoiseKeys keys = noise_keys(seed);
  const float* w_ptr = weights.data_ptr<float>();
  const float* m_ptr = mask.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "velocity_deviation_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* score_ptr = score.data_ptr<acc_t>();
    const acc_t norm = acc_t(1) / static_cast<acc_t>(s.layers * s.steps * s.dim);
    const scalar_t* v_ptr = v.data_ptr<scalar_t>();
    const scalar_t* x1_ptr = x1.data_ptr<scalar_t>();
    at::parallel_for(0, s.tokens, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> eps(s.dim);
      for (int64_t n = begin; n < end; ++n) {
        if (m_ptr[n] == 0.0f) {  // masked tokens score 0 and are not computed
          score_ptr[n] = acc_t(0);
          continue;
        }
        acc_t total = acc_t(0);
        for (int64_t p = 0; p < s.layers; ++p) {
          const scalar_t* x = x1_ptr + (p * s.tokens + n) * s.dim;
          for (int64_t t = 0; t < s.steps; ++t) {
            const int64_t pt = p * s.steps + t, row = pt * s.tokens + n;
            fill_noise(keys, deviation_noise_base(token_offset + n, s.layers * s.steps, pt, s.dim), s.dim, eps.data());
            const scalar_t* vr = v_ptr + row * s.dim;
            total += static_cast<acc_t>(w_ptr[t]) * squared_deviation<acc_t>(vr, x, eps.data(), s.dim);
          }
        }
        score_ptr[n] = static_cast<acc_t>(m_ptr[n]) * total * norm;
      }
    });
  });
  return score;
}

at::Tensor velocity_deviation_backward_cpu(const at::Tensor& grad_in, const at::Tensor& v_in, const at::Tensor& x1_in,
                                           const at::Tensor& timesteps_in, const at::Tensor& weights_in, int64_t seed,
                                           int64_t token_offset, const at::Tensor& mask_in) {
  const Shapes s = check_inputs(x1_in, timesteps_in);
  check_stacked(v_in, x1_in, s, weights_in, mask_in);
  TORCH_CHECK(grad_in.numel() == s.tokens, "grad_score must be (N,)");
  const at::Tensor v = v_in.contiguous(), x1 = x1_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor mask = mask_in.contiguous(), grad = grad_in.contiguous();
  at::Tensor grad_v = at::empty_like(v);
  const NoiseKeys keys = noise_keys(seed);
  const float* w_ptr = weights.data_ptr<float>();
  const float* m_ptr = mask.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "velocity_deviation_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor grad_acc = grad.to(c10::CppTypeToScalarType<acc_t>::value);
    const acc_t* g_ptr = grad_acc.data_ptr<acc_t>();
    const acc_t norm = acc_t(2) / static_cast<acc_t>(s.layers * s.steps * s.dim);
    const scalar_t* v_ptr = v.data_ptr<scalar_t>();
    const scalar_t* x1_ptr = x1.data_ptr<scalar_t>();
    scalar_t* gv_ptr = grad_v.data_ptr<scalar_t>();
    at::parallel_for(0, s.layers * s.steps * s.tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> eps(s.dim);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row % s.tokens, pt = row / s.tokens, p = pt / s.steps;
        const acc_t coef = norm * g_ptr[n] * static_cast<acc_t>(m_ptr[n]) * static_cast<acc_t>(w_ptr[pt % s.steps]);
        scalar_t* gr = gv_ptr + row * s.dim;
        if (coef == acc_t(0)) {
          for (int64_t j = 0; j < s.dim; ++j) gr[j] = static_cast<scalar_t>(0.0f);
          continue;
        }
        fill_noise(keys, deviation_noise_base(token_offset + n, s.layers * s.steps, pt, s.dim), s.dim, eps.data());
        const scalar_t* vr = v_ptr + row * s.dim;
        const scalar_t* x = x1_ptr + (p * s.tokens + n) * s.dim;
        for (int64_t j = 0; j < s.dim; ++j)
          gr[j] = static_cast<scalar_t>(coef * (static_cast<acc_t>(vr[j]) - static_cast<acc_t>(x[j]) + static_cast<acc_t>(eps[j])));
      }
    });
  });
  return grad_v;
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("interpolate_latents", &interpolate_latents_cpu);
  m.impl("velocity_deviation", &velocity_deviation_cpu);
  m.impl("velocity_deviation_backward", &velocity_deviation_backward_cpu);
}

}  // namespace flowkit
