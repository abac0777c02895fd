// exp_nonpositive: a branch-free e^x for x ≤ 0 that CPU loops vectorise (the softmax kernels' exponential).
#pragma once

#include <cstdint>

namespace flowkit {

// e^x for x ≤ 0, branch-free so loops vectorise: 2^n · p(r) with x = n·ln2 + r, |r| ≤ ln2/2, Cephes' degree-6
// polynomial (≤ 2 ulp against libm's expf); 0 below −87 (where e^x is under float32's normal range).
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = __builtin_roundf(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

}  // namespace flowkit
