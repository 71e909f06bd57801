// exp for the softmax of decode attention and for silu (decode_attention.cpp,
// attention_avx512.cpp): one rule of its range, written once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x), branch-free so the compiler vectorizes the loops that call it (the softmax's,
// silu's). Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r), then 2^n built in the exponent bits; about 1 ulp, like the vectorized exp
// PyTorch's kernels use. x is held to [-87, 88]: below, exp is under 2^-125 (nothing
// next to a softmax's largest 1, or to silu's 1 + exp); above, 2^n would overflow the
// exponent (silu(x) = x / (1 + exp(-x)) below x = -88 is then x * 6e-39 where it is
// smaller still: under 1e-36 either way).
inline float exp_bounded(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
