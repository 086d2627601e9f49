// Shared scalar helpers of the CPU loop: the hash of the random bits (its constants come from ops/rng.py as
// defines), bf16 widening, and the roundings (nearest, stochastic, stochastic of an exact sum); the step's scalars.
#pragma once

#if !defined(MIX_MUL1) || !defined(MIX_MUL2) || !defined(MIX_SHIFT1) || !defined(MIX_SHIFT2) || !defined(MIX_SHIFT3)
#error "the hash constants come from ops/rng.py as defines (ops/update_cpu.py passes them)"
#endif
#if !defined(ROUNDING_NEAREST) || !defined(ROUNDING_STOCHASTIC) || !defined(ROUNDING_KAHAN) || \
    !defined(ALGORITHM_LION) || !defined(ALGORITHM_SGD)
#error "the rounding and algorithm codes come from ops/algorithms.py as defines (ops/update_cpu.py passes them)"
#endif
// The loops' template argument ROUNDING spells the codes as 0, 1, 2: they must be ops.algorithms.ROUNDING_CODES.
static_assert(ROUNDING_NEAREST == 0 && ROUNDING_STOCHASTIC == 1 && ROUNDING_KAHAN == 2,
              "the loops number the roundings as ops.algorithms.ROUNDING_CODES did");

#include <ATen/ATen.h>
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
// to the float32 rounding of the sum before the stochastic rounding to bf16. 32-bit integers and float32 only, with
// selects instead of branches, so the loop vectorizes; the same operations as the other backends.
PB16_INLINE uint16_t round_stochastic_sum(float a, float b, uint32_t r) {
  const float s = a + b;
  const float bb = s - a;
  const float e = (a - (s - bb)) + (b - bb);
  const uint32_t sb = bits_of(s);
  const uint32_t mag = sb & 0x7FFFFFFFu;
  const float err = float_of(bits_of(e) ^ (sb & 0x80000000u));  // positive away from zero
  // The float32 spacing on the side the error points to (half the other below a normal power of two).
  const float spacing = std::fabs(float_of(err < 0.0f ? mag - 1u : mag + 1u) - float_of(mag));
  // carry = floor((D * 2**16 + r + F) / 2**32), in {-1, 0, 1}, with u = D * 2**16 + r modulo 2**32.
  const uint32_t u = (mag << 16) + r;
  const int32_t u_signed = static_cast<int32_t>(u);
  const int32_t carry = static_cast<int32_t>(u < r) + static_cast<int32_t>(u_signed < 0) -
                        static_cast<int32_t>(err * 65536.0f < -static_cast<float>(u_signed) * spacing);
  const uint32_t kept = mag >> 16;
  const uint32_t out = static_cast<uint32_t>(static_cast<int32_t>(kept) + carry);
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
  float grad_scale = 1.0f;  // the gradient's factor (a caller's clipping); 1: the gradient as it is, no product
};

// The step's scalars as float32, exactly as torch turns a Python float into the scalar of a float32 tensor op.
inline Scalars scalars_of(double beta1, double one_minus_beta1, double beta2, double one_minus_beta2, double eps,
                          double weight_decay, double decay, double neg_step_size, double inv_bias_correction2_sqrt,
                          double grad_scale) {
  return Scalars{static_cast<float>(beta1),
                 static_cast<float>(one_minus_beta1),
                 static_cast<float>(beta2),
                 static_cast<float>(one_minus_beta2),
                 static_cast<float>(eps),
                 static_cast<float>(weight_decay),
                 static_cast<float>(decay),
                 static_cast<float>(neg_step_size),
                 static_cast<float>(inv_bias_correction2_sqrt),
                 static_cast<float>(grad_scale)};
}

constexpr int64_t CHUNK = 64;
