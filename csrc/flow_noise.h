// Counter-based Gaussian noise shared by the C++ and CUDA kernels; the specification (and the PyTorch
// reference) is flowkit/kernels/rng.py. Integer steps are bit-exact; log and cos use branch-free float
// polynomials (so CPU loops vectorise) that agree with libm to a few ulp.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FLOWKIT_HD __host__ __device__ __forceinline__
#else
#define FLOWKIT_HD inline __attribute__((always_inline))  // so target_clones copies get vector code
#endif

namespace flowkit {

struct NoiseKeys {
  uint32_t k0;
  uint32_t k1;
};

FLOWKIT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline NoiseKeys noise_keys(int64_t seed) {
  const uint32_t s = static_cast<uint32_t>(seed);
  return NoiseKeys{mix32(s), mix32(s + 0x9E3779B9u)};
}

FLOWKIT_HD float bits_as_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  __builtin_memcpy(&f, &b, sizeof(f));
  return f;
#endif
}

FLOWKIT_HD uint32_t float_as_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  __builtin_memcpy(&b, &f, sizeof(b));
  return b;
#endif
}

// Natural log for x in (0, 1] (Cephes logf polynomial on the mantissa reduced to [sqrt(1/2), sqrt(2))).
FLOWKIT_HD float log_unit(float x) {
  const uint32_t bits = float_as_bits(x);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
  float m = bits_as_float((bits & 0x007FFFFFu) | 0x3F000000u);  // mantissa in [0.5, 1)
  const bool small = m < 0.70710678118654752f;
  e = small ? e - 1.0f : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// cos(2π u) for u in [0, 1): fold to a in [-1/4, 1/4] with cos(2πu) = -sin(2π a) on the folded half-turn.
FLOWKIT_HD float cos_two_pi(float u) {
  const float folded = u < 0.5f ? u : 1.0f - u;  // cos(2πu) = cos(2π(1-u)), folded in [0, 1/2]
  const float x = 6.28318530717958648f * (folded - 0.25f);  // in [-π/2, π/2]
  const float x2 = x * x;
  float s = -2.5052108385e-8f;
  s = s * x2 + 2.7557319224e-6f;
  s = s * x2 - 1.9841269841e-4f;
  s = s * x2 + 8.3333333333e-3f;
  s = s * x2 - 1.6666666667e-1f;
  return -(x + x * x2 * s);
}

// Standard normal draw for linear counter c = offset + index (Box–Muller on two 24-bit uniforms).
FLOWKIT_HD float noise_at(NoiseKeys keys, uint64_t counter) {
  const uint32_t lo = static_cast<uint32_t>(counter);
  const uint32_t hi = static_cast<uint32_t>(counter >> 32);
  const uint32_t b0 = mix32(mix32(lo ^ keys.k0) ^ hi);
  const uint32_t b1 = mix32(mix32(lo ^ keys.k1) ^ hi);
  const float u1 = static_cast<float>((b0 >> 8) + 1u) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>(b1 >> 8) * (1.0f / 16777216.0f);
  const float r2 = -2.0f * log_unit(u1);
#ifdef __CUDA_ARCH__
  return sqrtf(r2) * cos_two_pi(u2);
#else
  return __builtin_sqrtf(r2) * cos_two_pi(u2);
#endif
}

// Counter of ε[p, t, n, 0] in the RLFR ops, token-major over the global token g = token_offset + n:
// (g·P·T + p·T + t)·d. A chunk of tokens thus regenerates exactly the noise of the whole batch.
FLOWKIT_HD uint64_t deviation_noise_base(int64_t global_token, int64_t groups, int64_t group, int64_t dim) {
  return static_cast<uint64_t>((global_token * groups + group) * dim);
}

}  // namespace flowkit
