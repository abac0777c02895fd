// CPU kernels for the SwiGLU gate of Llama-family MLPs (flowkit::swiglu[_backward]): silu(gate)·up in one pass,
// and both gradients in one pass that recomputes the sigmoid, where PyTorch's silu, mul and their backwards make
// about seven passes over M × intermediate floats and allocate four such tensors (each page-faulted in anew).
// Parallel over elements with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "../fast_exp.h"
#include "../simd_clones.h"

namespace flowkit {
namespace {

constexpr int64_t kGrain = 16384;

inline __attribute__((always_inline)) float sigmoid(float x) {
  const float e = exp_nonpositive(x < 0.0f ? x : -x);  // e^{-|x|}: no overflow on either side
  return x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

FLOWKIT_SIMD_CLONES void swiglu_range(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

// d/dgate silu(g)·u = u·σ(g)·(1 + g·(1 − σ(g))); d/dup = silu(g).
FLOWKIT_SIMD_CLONES void swiglu_backward_range(const float* grad, const float* gate, const float* up,
                                               float* grad_gate, float* grad_up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(gate[i]);
    grad_up[i] = grad[i] * gate[i] * s;
    grad_gate[i] = grad[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
  }
}

void check_pair(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                  b.is_contiguous() && a.sizes() == b.sizes(),
              "swiglu takes contiguous float32 tensors of one shape");
}

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  check_pair(gate, up);
  at::Tensor out = at::empty_like(gate);
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), kGrain, [&](int64_t begin, int64_t end) {
    swiglu_range(g + begin, u + begin, o + begin, end - begin);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_in, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  check_pair(gate, up);
  const at::Tensor grad = grad_in.contiguous();
  check_pair(grad, gate);
  at::Tensor grad_gate = at::empty_like(gate), grad_up = at::empty_like(up);
  const float *d = grad.data_ptr<float>(), *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float *dg = grad_gate.data_ptr<float>(), *du = grad_up.data_ptr<float>();
  at::parallel_for(0, gate.numel(), kGrain, [&](int64_t begin, int64_t end) {
    swiglu_backward_range(d + begin, g + begin, u + begin, dg + begin, du + begin, end - begin);
  });
  return {grad_gate, grad_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace flowkit
