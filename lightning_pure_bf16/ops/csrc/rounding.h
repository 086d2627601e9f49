// Shared scalar helpers of the CPU loop: the hash of the random bits (its constants come from ops/rng.py as
// defines), bf16 widening, and the roundings (nearest, stochastic, stochastic of an exact sum); the step's scalars.
#pragma once

#if !defined(MIX_MUL1) || !defined(MIX_MUL2) || !defined(MIX_SHIFT1) || !defined(MIX_SHIFT2) || !defined(MIX_SHIFT3)
#error "the hash constants come from ops/rng.py as defines (ops/adamw_cpu.py passes them)"
#endif

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

// Forced inlining: a helper left as a call (as GCC does for the larger ones inside at::parallel_for's lambda) stops the
// loop from vectorizing, about 10x slower.
#define PB16_INLINE inline __attribute__((always_inline))

namespace {

PB16_INLINE uint32_t mix32(uint32_t x) {
  x ^= x >> MIX_SHIFT1;
  x *= MIX_MUL1;
  x ^= x >> MIX_SHIFT2;
  x *= MIX_MUL2;
  x ^= x >> MIX_SHIFT3;
  return x;
}
PB16_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
PB16_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
PB16_INLINE float widen(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
// Stochastic rounding: 16 random bits added below the kept 16 carry into them with the discarded fraction's odds.
PB16_INLINE uint16_t round_stochastic(float x, uint32_t r) {
  return static_cast<uint16_t>((bits_of(x) + (r & 0xFFFFu)) >> 16);
}
// Stochastic rounding of the exact sum a + b at 2**-32 of a bf16 ulp (rounding.stochastic_round_sum_bf16 explains
// each step): the float32 sum and its TwoSum error both take part, so an update of 1e-7 of the weight is not lost
// to the float32 rounding of the sum before the stochastic rounding to bf16. All 32-bit integers, with the carry of
// the fraction computed explicitly, and selects instead of branches, so the loop vectorizes (a float-to-int
// conversion does not, with GCC's default trapping math); the same result as the int64 arithmetic of the others.
PB16_INLINE uint16_t round_stochastic_sum(float a, float b, uint32_t r) {
  const float s = a + b;
  const float bb = s - a;
  const float e = (a - (s - bb)) + (b - bb);
  const uint32_t sb = bits_of(s), eb = bits_of(e);
  const uint32_t mag = sb & 0x7FFFFFFFu;
  const int32_t s_exp = static_cast<int32_t>(mag >> 23);
  const int32_t e_exp = static_cast<int32_t>((eb >> 23) & 0xFFu);
  const uint32_t e_mant = (eb & 0x7FFFFFu) | (static_cast<uint32_t>(e_exp != 0) << 23);
  // |e| in units of 2**-32 bf16 ulp of s: e_mant * 2**(16 - gap), truncated (gap < 16 only for e = 0 or a
  // subnormal e under a tiny s, where the result stays below 2**16).
  const int32_t gap = std::max(s_exp, 1) - std::max(e_exp, 1);
  const uint32_t shifted_down = e_mant >> std::min(std::max(gap - 16, 0), 31);
  const uint32_t shifted_up = e_mant << std::min(std::max(16 - gap, 0), 16);
  uint32_t frac = gap >= 16 ? shifted_down : shifted_up;
  // Below a normal power of two the bf16 spacing halves: a step down from s counts double. (& not &&: no branches.)
  const bool against = (((sb ^ eb) >> 31) != 0) & (frac != 0);
  const bool halved = against & ((mag & 0x7FFFFFu) == 0) & (mag >= 0x01000000u);
  frac = halved ? frac * 2 : frac;
  // carry = floor((low +/- frac + r) / 2**32), in {-1, 0, 1}.
  const uint32_t low = (mag & 0xFFFFu) << 16;
  const uint32_t t = low + r;
  const int32_t c1 = static_cast<int32_t>(t < low);
  const uint32_t u = against ? t - frac : t + frac;
  const int32_t c2 = against ? -static_cast<int32_t>(u > t) : static_cast<int32_t>(u < t);
  const uint32_t kept = mag >> 16;
  const uint32_t out = static_cast<uint32_t>(static_cast<int32_t>(kept) + c1 + c2);
  const uint32_t special = kept | (static_cast<uint32_t>(mag > 0x7F800000u) << 6);  // inf stays inf, NaN quiet
  return static_cast<uint16_t>((mag < 0x7F800000u ? out : special) | ((sb >> 16) & 0x8000u));
}

PB16_INLINE uint16_t round_nearest(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x0040u;  // a NaN stays a NaN instead of carrying into the exponent
  const bool is_nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);  // a select, not a branch: the loop vectorizes
}

// Stochastic rounding of the exact sum a + b, the common case (the vector loops do the same lane by lane). The float32
// sum's 16 discarded bits plus the random bits' high half carry into the kept half exactly when the discarded bits
// plus all 32 random bits do (the low halves alone cannot carry), so one add rounds. TwoSum's error e would move that
// sum by at most 2**16 units of 2**-32 bf16 ulp (|e| <= half a float32 ulp of s, doubled below a power of two), which
// changes the carry only within 2**16 of a carry boundary: `exact` is set within 2**17 (the discarded bits plus the
// high random half within 2 of zero mod 2**16, one element in 2**14 by the random bits) and for |s| or |a| at or above
// 2**126 or not finite (TwoSum's steps may overflow; tested on the OR of the magnitudes, at least the larger one, so
// a rare false alarm costs an exact decision, never a wrong one), and round_stochastic_sum decides those.
PB16_INLINE uint16_t round_stochastic_sum_fast(float a, float b, uint32_t r, uint32_t& exact) {
  const uint32_t sb = bits_of(a + b);
  const uint32_t u = sb + (r >> 16);
  exact |= static_cast<uint32_t>(((u + 2u) & 0xFFFCu) == 0u) |
           static_cast<uint32_t>(((sb | bits_of(a)) & 0x7FFFFFFFu) >= 0x7E800000u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

// Whether the explicit vector loops run (the tests switch them off to check the portable loops on the same CPU).
static std::atomic<bool> vector_loops{true};

struct Scalars {
  float b1, omb1, b2, omb2, eps, wd, decay, neg_step, inv_bc2;
};

// The step's scalars as float32, exactly as torch turns a Python float into the scalar of a float32 tensor op.
inline Scalars scalars_of(double beta1, double one_minus_beta1, double beta2, double one_minus_beta2, double eps,
                          double weight_decay, double decay, double neg_step_size, double inv_bias_correction2_sqrt) {
  return Scalars{static_cast<float>(beta1),
                 static_cast<float>(one_minus_beta1),
                 static_cast<float>(beta2),
                 static_cast<float>(one_minus_beta2),
                 static_cast<float>(eps),
                 static_cast<float>(weight_decay),
                 static_cast<float>(decay),
                 static_cast<float>(neg_step_size),
                 static_cast<float>(inv_bias_correction2_sqrt)};
}

constexpr int64_t CHUNK = 64;
