// Scalar helpers for the native CPU ops, written so that loops over them vectorise (-O3 -march=native).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tandem {

// exp(x) in plain arithmetic the compiler vectorises (std::exp stays a scalar libm call per element):
// 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for precision), p a degree-6
// Taylor polynomial; relative error ~2e-7. x is clamped to [-87, 88] (2^n stays a normal float) and
// inputs below -87 give 0 (the true value, < 2e-38, is below float32's normal range).
inline float exp_clamped(float x) {
  const bool underflow = x < -87.0f;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return underflow ? 0.f : p * scale;
}

inline float as_float(float x) { return x; }

inline float as_float(at::BFloat16 x) {  // exact: a bfloat16 is the top half of a float32
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(float));
  return f;
}

// x rounded to bfloat16 (round to nearest even; a NaN becomes bfloat16's canonical 0x7FC0) as float32
// bits: the bfloat16 in the top half, zeros below. Bit for bit what c10::BFloat16(float) gives, in integer
// arithmetic the compiler vectorises: c10's constructor stays a scalar call per element inside `omp simd`
// loops, which made the bfloat16 ops many times slower than their float32 twins.
inline uint32_t bf16_rounded_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(float));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded;
}

// x rounded to T (bf16_rounded_bits for bfloat16).
template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) { return x; }

template <>
inline at::BFloat16 from_float<at::BFloat16>(float x) {
  return at::BFloat16(static_cast<uint16_t>(bf16_rounded_bits(x) >> 16), at::BFloat16::from_bits());
}

// x rounded to T and widened back to float32 (as_float(from_float<T>(x)), without leaving float lanes).
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const uint32_t bits = bf16_rounded_bits(x);
    float f;
    std::memcpy(&f, &bits, sizeof(float));
    return f;
  }
}

}  // namespace tandem
