// CUDA kernels for the RLFR prologue / epilogue; same contract and noise as velocity_deviation_cpu.cpp.
// Prologue and backward are elementwise over the stacked (P·T·N, d) rows (ε counter: deviation_noise_base);
// the epilogue runs one block per token and reduces its P·T rows.
// ATen's per-operator headers instead of ATen/ATen.h (every op's declaration): ~40% less for nvcc's three passes
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../cuda_utils.cuh"
#include "../flow_noise.h"

namespace flowkit {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void interpolate_kernel(const scalar_t* __restrict__ x1, const float* __restrict__ timesteps,
                                   scalar_t* __restrict__ out, NoiseKeys keys, int64_t total, int64_t layers,
                                   int64_t tokens, int64_t steps, int64_t dim, int64_t token_offset) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = idx / dim, j = idx % dim;
    const int64_t n = row % tokens, pt = row / tokens, p = pt / steps;
    const acc_t t = static_cast<acc_t>(timesteps[pt % steps]);
    const acc_t x = static_cast<acc_t>(x1[(p * tokens + n) * dim + j]);
    const uint64_t counter = deviation_noise_base(token_offset + n, layers * steps, pt, dim) + j;
    out[idx] = static_cast<scalar_t>(t * x + (acc_t(1) - t) * static_cast<acc_t>(noise_at(keys, counter)));
  }
}

template <typename scalar_t>
__global__ void deviation_kernel(const scalar_t* __restrict__ v, const scalar_t* __restrict__ x1,
                                 const float* __restrict__ weights, const float* __restrict__ mask,
                                 at::opmath_type<scalar_t>* __restrict__ score, NoiseKeys keys, int64_t layers,
                                 int64_t steps, int64_t tokens, int64_t dim, int64_t token_offset) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = blockIdx.x;
  if (mask[n] == 0.0f) {  // masked tokens score 0 and are not computed
    if (threadIdx.x == 0) score[n] = acc_t(0);
    return;
  }
  acc_t total = acc_t(0);
  for (int64_t p = 0; p < layers; ++p) {
    const scalar_t* x = x1 + (p * tokens + n) * dim;
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t pt = p * steps + t;
      const scalar_t* vr = v + (pt * tokens + n) * dim;
      const uint64_t base = deviation_noise_base(token_offset + n, layers * steps, pt, dim);
      acc_t acc = acc_t(0);
      for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
        const acc_t eps = static_cast<acc_t>(noise_at(keys, base + j));
        const acc_t diff = static_cast<acc_t>(vr[j]) - static_cast<acc_t>(x[j]) + eps;
        acc += diff * diff;
      }
      total += static_cast<acc_t>(weights[t]) * acc;
    }
  }
  total = block_sum(total);
  if (threadIdx.x == 0) score[n] = static_cast<acc_t>(mask[n]) * total / static_cast<acc_t>(layers * steps * dim);
}

template <typename scalar_t>
__global__ void deviation_backward_kernel(const at::opmath_type<scalar_t>* __restrict__ grad,
                                          const scalar_t* __restrict__ v, const scalar_t* __restrict__ x1,
                                          const float* __restrict__ weights, const float* __restrict__ mask,
                                          scalar_t* __restrict__ grad_v, NoiseKeys keys, int64_t total, int64_t layers,
                                          int64_t tokens, int64_t steps, int64_t dim, int64_t token_offset) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t norm = acc_t(2) / static_cast<acc_t>(layers * steps * dim);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = idx / dim, j = idx % dim;
    const int64_t n = row % tokens, pt = row / tokens, p = pt / steps;
    const acc_t coef = norm * grad[n] * static_cast<acc_t>(mask[n]) * static_cast<acc_t>(weights[pt % steps]);
    const acc_t eps = static_cast<acc_t>(noise_at(keys, deviation_noise_base(token_offset + n, layers * steps, pt, dim) + j));
    const acc_t diff = static_cast<acc_t>(v[idx]) - static_cast<acc_t>(x1[(p * tokens + n) * dim + j]) + eps;
    grad_v[idx] = static_cast<scalar_t>(coef * diff);
  }
}

int elementwise_blocks(int64_t total) {
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t cap = int64_t(sms) * 32;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
}

void check_vectors(const at::Tensor& x1, const at::Tensor& timesteps) {
  TORCH_CHECK(x1.dim() == 3, "x1 must be (P, N, d)");
  TORCH_CHECK(timesteps.dim() == 1 && timesteps.scalar_type() == at::kFloat, "timesteps must be a float32 vector");
  TORCH_CHECK(timesteps.device() == x1.device(), "timesteps must be on the device of x1");
}

at::Tensor interpolate_latents_cuda(const at::Tensor& x1_in, const at::Tensor& timesteps_in, int64_t seed,
                                   int64_t token_offset) {
  check_vectors(x1_in, timesteps_in);
  const c10::cuda::CUDAGuard guard(x1_in.device());
  const at::Tensor x1 = x1_in.contiguous(), timesteps = timesteps_in.contiguous();
  const int64_t layers = x1.size(0), tokens = x1.size(1), dim = x1.size(2), steps = timesteps.size(0);
  at::Tensor out = at::empty({layers * steps * tokens, dim}, x1.options());
  const int64_t total = out.numel();
  if (total == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "interpolate_latents_cuda", [&] {
    interpolate_kernel<scalar_t><<<elementwise_blocks(total), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x1.data_ptr<scalar_t>(), timesteps.data_ptr<float>(), out.data_ptr<scalar_t>(), noise_keys(seed), total,
        layers, tokens, steps, dim, token_offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor velocity_deviation_cuda(const at::Tensor& v_in, const at::Tensor& x1_in, const at::Tensor& timesteps_in,
                                   const at::Tensor& weights_in, int64_t seed, int64_t token_offset,
                                   const at::Tensor& mask_in) {
  check_vectors(x1_in, timesteps_in);
  const c10::cuda::CUDAGuard guard(v_in.device());
  const at::Tensor v = v_in.contiguous(), x1 = x1_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  const int64_t layers = x1.size(0), tokens = x1.size(1), dim = x1.size(2), steps = timesteps_in.size(0);
  TORCH_CHECK(v.dim() == 2 && v.size(0) == layers * steps * tokens && v.size(1) == dim, "v must be (P*T*N, d)");
  TORCH_CHECK(weights.numel() == steps && mask.numel() == tokens && weights.scalar_type() == at::kFloat &&
                  mask.scalar_type() == at::kFloat,
              "weights (T,) and mask (N,) must be float32");
  at::Tensor score = at::empty({tokens}, v.options().dtype(v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  if (tokens == 0) return score;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "velocity_deviation_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    deviation_kernel<scalar_t><<<tokens, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        v.data_ptr<scalar_t>(), x1.data_ptr<scalar_t>(), weights.data_ptr<float>(), mask.data_ptr<float>(),
        score.data_ptr<acc_t>(), noise_keys(seed), layers, steps, tokens, dim, token_offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return score;
}

at::Tensor velocity_deviation_backward_cuda(const at::Tensor& grad_in, const at::Tensor& v_in, const at::Tensor& x1_in,
                                            const at::Tensor& timesteps_in, const at::Tensor& weights_in, int64_t seed,
                                            int64_t token_offset, const at::Tensor& mask_in) {
  check_vectors(x1_in, timesteps_in);
  const c10::cuda::CUDAGuard guard(v_in.device());
  const at::Tensor v = v_in.contiguous(), x1 = x1_in.contiguous(), weights = weights_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  const int64_t layers = x1.size(0), tokens = x1.size(1), dim = x1.size(2), steps = timesteps_in.size(0);
  at::Tensor grad_v = at::empty_like(v);
  const int64_t total = v.numel();
  if (total == 0) return grad_v;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "velocity_deviation_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor grad = grad_in.contiguous().to(c10::CppTypeToScalarType<acc_t>::value);
    deviation_backward_kernel<scalar_t><<<elementwise_blocks(total), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad.data_ptr<acc_t>(), v.data_ptr<scalar_t>(), x1.data_ptr<scalar_t>(), weights.data_ptr<float>(),
        mask.data_ptr<float>(), grad_v.data_ptr<scalar_t>(), noise_keys(seed), total, layers, tokens, steps, dim,
        token_offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_v;
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CUDA, m) {
  m.impl("interpolate_latents", &interpolate_latents_cuda);
  m.impl("velocity_deviation", &velocity_deviation_cuda);
  m.impl("velocity_deviation_backward", &velocity_deviation_backward_cuda);
}

}  // namespace flowkit
