"""The fused CPU loop of the pure-bf16 Adam/AdamW update: one pass over p, g, m, v (and the Kahan buffer), and a
one-pass check of bf16 gradients for inf/NaN.

A small C++ function, compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are needed;
without them the optimizer falls back to the chunked PyTorch path, with a warning). It performs exactly the PyTorch
path's float32 operations in the same order, with fused multiply-add contraction off, and draws the same random bits
(``ops.rng``), so the two give identical results bit for bit. bf16 parameters and gradients only.

The loops run in explicit AVX-512 or AVX2 vector code where the build targets them (one template, two sets of
instructions; for 8-bit states, whole blocks of 128 elements) and in portable loops the compiler vectorizes elsewhere;
``use_vector_loops(False)`` switches the vector code off (tests). Both decide the stochastic rounding of the exact sum
``p + update`` from the float32 sum's discarded bits plus the random bits, and hand the rare elements whose decision
the sum's rounding error could change (within 2**17 of a carry: one in 2**14) to the exact computation, so the bits
stay the PyTorch path's. The 8-bit vector loop divides by 127 and 255 (the codes' levels) and by the Kahan
remainder's power-of-two unit without the divider, with the division's results (every level is checked against the
division by the tests).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_pure_bf16.ops import rng
from lightning_pure_bf16.ops.adamw_torch import UpdateArgs

_ROUNDING_CODES = {"nearest": 0, "stochastic": 1, "kahan": 2}

_SOURCE = r"""
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
PB16_INLINE uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
PB16_INLINE float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
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

constexpr int64_t CHUNK = 64;

// The portable loop: chunks of CHUNK elements the compiler vectorizes, each followed by the exact decision of its
// parameter (or Kahan remainder) where a rare element needs it.
template <int ROUNDING, bool L2, bool DECOUPLED>
void update_portable(uint16_t* __restrict__ P, const uint16_t* __restrict__ G, uint16_t* __restrict__ M,
                     uint16_t* __restrict__ V, uint16_t* __restrict__ C, int64_t begin, int64_t end, const Scalars& s,
                     uint32_t kp, uint32_t km, uint32_t kv, uint32_t lo_offset) {
  alignas(64) float abuf[CHUNK];
  alignas(64) float bbuf[CHUNK];
  for (int64_t c0 = begin; c0 < end; c0 += CHUNK) {
    const int64_t cn = std::min(CHUNK, end - c0);
    uint32_t exact = 0;
    uint16_t* __restrict__ Pc = P + c0;
    const uint16_t* __restrict__ Gc = G + c0;
    uint16_t* __restrict__ Mc = M + c0;
    uint16_t* __restrict__ Vc = V + c0;
    uint16_t* __restrict__ Cc = ROUNDING == 2 ? C + c0 : nullptr;
    const uint32_t lo0 = static_cast<uint32_t>(c0) + lo_offset;
    for (int64_t j = 0; j < cn; ++j) {
      const uint32_t lo = lo0 + static_cast<uint32_t>(j);
      const float p = widen(Pc[j]);
      float g = widen(Gc[j]);
      float m = widen(Mc[j]);
      float v = widen(Vc[j]);
      if (L2) g = g + p * s.wd;
      v = v * s.b2 + (g * g) * s.omb2;
      m = m * s.b1 + g * s.omb1;
      float delta = (m / (std::sqrt(v) * s.inv_bc2 + s.eps)) * s.neg_step;
      if (DECOUPLED) delta = delta - p * s.decay;
      if (ROUNDING == 0) {
        Pc[j] = round_nearest(p + delta);
        Mc[j] = round_nearest(m);
        Vc[j] = round_nearest(v);
      } else {
        if (ROUNDING == 2) {
          const float c = widen(Cc[j]);
          const uint16_t out = round_nearest(p + (delta + c));
          const float a = c - (widen(out) - p);
          Cc[j] = round_stochastic_sum_fast(a, delta, mix32(lo ^ kp), exact);
          abuf[j] = a;
          Pc[j] = out;
        } else {
          Pc[j] = round_stochastic_sum_fast(p, delta, mix32(lo ^ kp), exact);
          abuf[j] = p;
        }
        bbuf[j] = delta;
        Mc[j] = round_stochastic(m, mix32(lo ^ km));
        Vc[j] = round_stochastic(v, mix32(lo ^ kv));
      }
    }
    if (ROUNDING != 0 && exact != 0) {
      uint16_t* __restrict__ target = ROUNDING == 2 ? Cc : Pc;
      for (int64_t j = 0; j < cn; ++j)
        target[j] = round_stochastic_sum(abuf[j], bbuf[j], mix32((lo0 + static_cast<uint32_t>(j)) ^ kp));
    }
  }
}


#if defined(__AVX2__)
#include <immintrin.h>
#define PB16_SIMD 1
// The loop in vector registers, 2 x LANES elements a step, the same operations as the scalar code lane by lane, for
// AVX-512 and for AVX2 (one loop, two sets of instructions). Widening: unpacking bf16 words with zeros puts each word
// in the high half of a 32-bit lane (a float), in two vectors holding elements {0-3, 8-11, ...} and {4-7, 12-15, ...}
// (unpacks work per 128-bit lane); packing the high halves of the two results back (a shift and an
// unsigned-saturating pack per 128-bit lane) restores the memory order. The index of each lane (its random bits)
// follows the same order.
namespace simd {
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  static constexpr int LANES = 16;
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;
  static PB16_INLINE F fset(float x) { return _mm512_set1_ps(x); }
  static PB16_INLINE I iset(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static PB16_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static PB16_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static PB16_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static PB16_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static PB16_INLINE F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static PB16_INLINE F as_f(I x) { return _mm512_castsi512_ps(x); }
  static PB16_INLINE I as_i(F x) { return _mm512_castps_si512(x); }
  static PB16_INLINE I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static PB16_INLINE I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static PB16_INLINE I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static PB16_INLINE I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int N>
  static PB16_INLINE I srli(I a) { return _mm512_srli_epi32(a, N); }
  static PB16_INLINE I iota_a() { return _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27); }
  static PB16_INLINE I iota_b() { return iadd(iota_a(), iset(4)); }
  static PB16_INLINE void unpack16(const uint16_t* src, F& a, F& b) {
    const I x = _mm512_loadu_si512(src), zero = _mm512_setzero_si512();
    a = as_f(_mm512_unpacklo_epi16(zero, x));
    b = as_f(_mm512_unpackhi_epi16(zero, x));
  }
  static PB16_INLINE void pack16(uint16_t* dst, I a, I b) {
    _mm512_storeu_si512(dst, _mm512_packus_epi32(srli<16>(a), srli<16>(b)));
  }
  static PB16_INLINE Mask none() { return 0; }
  static PB16_INLINE Mask either(Mask a, Mask b) { return a | b; }
  static PB16_INLINE bool any(Mask m) { return m != 0; }
  // ((x & y) == 0) per lane.
  static PB16_INLINE Mask zero_and(I x, I y) { return _mm512_testn_epi32_mask(x, y); }
  // x >= y per lane, both below 2**31.
  static PB16_INLINE Mask at_least(I x, I y) { return _mm512_cmpge_epu32_mask(x, y); }
  // (a | b) & m
  static PB16_INLINE I or_and(I a, I b, I m) { return _mm512_ternarylogic_epi32(a, b, m, 0xA8); }
  static PB16_INLINE I select(Mask m, I yes, I no) { return _mm512_mask_blend_epi32(m, no, yes); }
  static PB16_INLINE I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static PB16_INLINE F loadf(const float* x) { return _mm512_loadu_ps(x); }
  static PB16_INLINE I loadi(const uint32_t* x) { return _mm512_loadu_si512(x); }
  // The high halves of the lanes, in lane order.
  static PB16_INLINE void store_high16(uint16_t* dst, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(srli<16>(x)));
  }
  // For the 8-bit loop: elements in memory order, 16 a vector.
  static PB16_INLINE I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static PB16_INLINE F widen(const uint16_t* src) {
    return as_f(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))),
                                  16));
  }
  static PB16_INLINE I load_i8(const int8_t* src) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
  static PB16_INLINE I load_u8(const uint8_t* src) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  }
  // The low bytes of the lanes (a truncating cast, as static_cast<int8_t> of an int32).
  static PB16_INLINE void store_low8(void* dst, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(x));
  }
  static PB16_INLINE void storef(float* dst, F x) { _mm512_storeu_ps(dst, x); }
  static PB16_INLINE F cvt_f(I x) { return _mm512_cvtepi32_ps(x); }
  static PB16_INLINE I cvtt_i(F x) { return _mm512_cvttps_epi32(x); }
  static PB16_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static PB16_INLINE F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // min/max return the second operand where either is a NaN.
  static PB16_INLINE F fmin(F a, F b) { return _mm512_min_ps(a, b); }
  static PB16_INLINE F fmax(F a, F b) { return _mm512_max_ps(a, b); }
  static PB16_INLINE F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static PB16_INLINE Mask lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static PB16_INLINE F selectf(Mask m, F yes, F no) { return _mm512_mask_blend_ps(m, no, yes); }
  static PB16_INLINE I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static PB16_INLINE I iabs(I a) { return _mm512_abs_epi32(a); }
  static PB16_INLINE I imin(I a, I b) { return _mm512_min_epi32(a, b); }
  static PB16_INLINE I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static PB16_INLINE I umax(I a, I b) { return _mm512_max_epu32(a, b); }
  static PB16_INLINE uint32_t hmax(I a) { return _mm512_reduce_max_epu32(a); }
  static PB16_INLINE I sllv(I a, I n) { return _mm512_sllv_epi32(a, n); }
  template <int N>
  static PB16_INLINE I slli(I a) { return _mm512_slli_epi32(a, N); }
  static PB16_INLINE I add_one_where(Mask m, I x) { return _mm512_mask_add_epi32(x, m, x, iset(1)); }
  static PB16_INLINE I negate_where(Mask m, I x) { return _mm512_mask_sub_epi32(x, m, _mm512_setzero_si512(), x); }
};
#endif
struct Avx2 {
  static constexpr int LANES = 8;
  using F = __m256;
  using I = __m256i;
  using Mask = __m256i;  // all ones or all zeros per lane
  static PB16_INLINE F fset(float x) { return _mm256_set1_ps(x); }
  static PB16_INLINE I iset(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static PB16_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static PB16_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static PB16_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static PB16_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static PB16_INLINE F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static PB16_INLINE F as_f(I x) { return _mm256_castsi256_ps(x); }
  static PB16_INLINE I as_i(F x) { return _mm256_castps_si256(x); }
  static PB16_INLINE I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static PB16_INLINE I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static PB16_INLINE I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static PB16_INLINE I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int N>
  static PB16_INLINE I srli(I a) { return _mm256_srli_epi32(a, N); }
  static PB16_INLINE I iota_a() { return _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11); }
  static PB16_INLINE I iota_b() { return iadd(iota_a(), iset(4)); }
  static PB16_INLINE void unpack16(const uint16_t* src, F& a, F& b) {
    const I x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), zero = _mm256_setzero_si256();
    a = as_f(_mm256_unpacklo_epi16(zero, x));
    b = as_f(_mm256_unpackhi_epi16(zero, x));
  }
  static PB16_INLINE void pack16(uint16_t* dst, I a, I b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_packus_epi32(srli<16>(a), srli<16>(b)));
  }
  static PB16_INLINE Mask none() { return _mm256_setzero_si256(); }
  static PB16_INLINE Mask either(Mask a, Mask b) { return _mm256_or_si256(a, b); }
  static PB16_INLINE bool any(Mask m) { return !_mm256_testz_si256(m, m); }
  static PB16_INLINE Mask zero_and(I x, I y) { return _mm256_cmpeq_epi32(_mm256_and_si256(x, y), none()); }
  static PB16_INLINE Mask at_least(I x, I y) { return _mm256_cmpgt_epi32(x, _mm256_sub_epi32(y, iset(1))); }
  static PB16_INLINE I or_and(I a, I b, I m) { return _mm256_and_si256(_mm256_or_si256(a, b), m); }
  static PB16_INLINE I select(Mask m, I yes, I no) { return _mm256_blendv_epi8(no, yes, m); }
  static PB16_INLINE I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static PB16_INLINE F loadf(const float* x) { return _mm256_loadu_ps(x); }
  static PB16_INLINE I loadi(const uint32_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
  static PB16_INLINE void store_high16(uint16_t* dst, I x) {
    const I y = srli<16>(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
  }
  static PB16_INLINE I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static PB16_INLINE F widen(const uint16_t* src) {
    return as_f(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
  }
  static PB16_INLINE I load_i8(const int8_t* src) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  }
  static PB16_INLINE I load_u8(const uint8_t* src) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  }
  static PB16_INLINE void store_low8(void* dst, I x) {
    // The low byte of each 32-bit lane to the front of its 128-bit lane, then the two groups of 4 side by side.
    const I bytes = _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            -1, -1));
    const I packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
  }
  static PB16_INLINE void storef(float* dst, F x) { _mm256_storeu_ps(dst, x); }
  static PB16_INLINE F cvt_f(I x) { return _mm256_cvtepi32_ps(x); }
  static PB16_INLINE I cvtt_i(F x) { return _mm256_cvttps_epi32(x); }
  static PB16_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static PB16_INLINE F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static PB16_INLINE F fmin(F a, F b) { return _mm256_min_ps(a, b); }
  static PB16_INLINE F fmax(F a, F b) { return _mm256_max_ps(a, b); }
  static PB16_INLINE F floor(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static PB16_INLINE Mask lt(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static PB16_INLINE F selectf(Mask m, F yes, F no) { return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(m)); }
  static PB16_INLINE I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static PB16_INLINE I iabs(I a) { return _mm256_abs_epi32(a); }
  static PB16_INLINE I imin(I a, I b) { return _mm256_min_epi32(a, b); }
  static PB16_INLINE I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static PB16_INLINE I umax(I a, I b) { return _mm256_max_epu32(a, b); }
  static PB16_INLINE uint32_t hmax(I a) {
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    return *std::max_element(lanes, lanes + 8);
  }
  static PB16_INLINE I sllv(I a, I n) { return _mm256_sllv_epi32(a, n); }
  template <int N>
  static PB16_INLINE I slli(I a) { return _mm256_slli_epi32(a, N); }
  static PB16_INLINE I add_one_where(Mask m, I x) { return _mm256_sub_epi32(x, m); }  // m is -1 where set
  static PB16_INLINE I negate_where(Mask m, I x) {
    return _mm256_blendv_epi8(x, _mm256_sub_epi32(_mm256_setzero_si256(), x), m);
  }
};

template <class A>
PB16_INLINE typename A::I mix32v(typename A::I x) {
  x = A::ixor(x, A::template srli<MIX_SHIFT1>(x));
  x = A::imul(x, A::iset(MIX_MUL1));
  x = A::ixor(x, A::template srli<MIX_SHIFT2>(x));
  x = A::imul(x, A::iset(MIX_MUL2));
  return A::ixor(x, A::template srli<MIX_SHIFT3>(x));
}
// Lanes whose high halves are the bf16 results (pack16 keeps those). Without NaN: b + 0x7FFF + (b >> 16 & 1).
template <class A>
PB16_INLINE typename A::I round_nearest_finite(typename A::I b) {
  return A::iadd(A::iadd(b, A::iset(0x7FFFu)), A::iand(A::template srli<16>(b), A::iset(1)));
}
template <class A>
PB16_INLINE typename A::I round_nearest_v(typename A::F x) {
  const typename A::I b = A::as_i(x);
  const typename A::I mag = A::iand(b, A::iset(0x7FFFFFFFu));
  const typename A::Mask nan = A::at_least(mag, A::iset(0x7F800001u));
  return A::select(nan, A::ior(b, A::iset(0x00400000u)), round_nearest_finite<A>(b));
}
template <class A>
PB16_INLINE typename A::I round_stochastic_v(typename A::F x, typename A::I r) {
  return A::iadd(A::as_i(x), A::iand(r, A::iset(0xFFFFu)));
}
// round_stochastic_sum_fast in vector form (its comment explains the decision); lanes that need the exact one are
// added to `exact`.
template <class A>
PB16_INLINE typename A::I round_stochastic_sum_v(typename A::F a, typename A::F b, typename A::I r,
                                                 typename A::Mask& exact) {
  const typename A::I sb = A::as_i(A::add(a, b));
  const typename A::I u = A::iadd(sb, A::template srli<16>(r));
  const typename A::Mask near = A::zero_and(A::iadd(u, A::iset(2)), A::iset(0xFFFCu));
  const typename A::I larger = A::or_and(sb, A::as_i(a), A::iset(0x7FFFFFFFu));
  exact = A::either(exact, A::either(near, A::at_least(larger, A::iset(0x7E800000u))));
  return u;
}

// The step's scalars in vector registers, and the Adam update of both loops (bf16 and 8-bit states): the new moments
// in m and v, the returned change of the parameter.
template <class A>
struct AdamConsts {
  typename A::F b1, omb1, b2, omb2, eps, wd, decay, neg_step, inv_bc2;
  explicit AdamConsts(const Scalars& s)
      : b1(A::fset(s.b1)), omb1(A::fset(s.omb1)), b2(A::fset(s.b2)), omb2(A::fset(s.omb2)), eps(A::fset(s.eps)),
        wd(A::fset(s.wd)), decay(A::fset(s.decay)), neg_step(A::fset(s.neg_step)), inv_bc2(A::fset(s.inv_bc2)) {}
};
template <class A, bool L2, bool DECOUPLED>
PB16_INLINE typename A::F adam_delta(typename A::F p, typename A::F g, typename A::F& m, typename A::F& v,
                                     const AdamConsts<A>& k) {
  if (L2) g = A::add(g, A::mul(p, k.wd));
  v = A::add(A::mul(v, k.b2), A::mul(A::mul(g, g), k.omb2));
  m = A::add(A::mul(m, k.b1), A::mul(g, k.omb1));
  typename A::F delta = A::mul(A::div(m, A::add(A::mul(A::sqrt(v), k.inv_bc2), k.eps)), k.neg_step);
  if (DECOUPLED) delta = A::sub(delta, A::mul(p, k.decay));
  return delta;
}

template <class A>
struct Step : AdamConsts<A> {
  typename A::I iota_a, iota_b, kp, km, kv;
  Step(const Scalars& s, uint32_t kp_, uint32_t km_, uint32_t kv_)
      : AdamConsts<A>(s), iota_a(A::iota_a()), iota_b(A::iota_b()), kp(A::iset(kp_)), km(A::iset(km_)),
        kv(A::iset(kv_)) {}
};

template <class A>
struct Out {
  typename A::I p, m, v, c;
};

template <class A, int ROUNDING, bool L2, bool DECOUPLED>
PB16_INLINE void update_lanes(Out<A>& o, typename A::F p, typename A::F g, typename A::F m, typename A::F v,
                              typename A::F c, typename A::I lo, const Step<A>& k, typename A::Mask& exact) {
  const typename A::F delta = adam_delta<A, L2, DECOUPLED>(p, g, m, v, k);
  if (ROUNDING == 0) {
    o.p = round_nearest_v<A>(A::add(p, delta));
    o.m = round_nearest_v<A>(m);
    o.v = round_nearest_v<A>(v);
    return;
  }
  const typename A::I rp = mix32v<A>(A::ixor(lo, k.kp));
  if (ROUNDING == 2) {
    // Round to nearest without the NaN case: a NaN here (its low 16 bits are zero, as every input is bf16 or a NaN
    // the CPU made, so the rounding keeps it a NaN) makes the remainder's sum below a NaN, and the group goes to the
    // portable loop, as for an inf.
    o.p = round_nearest_finite<A>(A::as_i(A::add(p, A::add(delta, c))));
    const typename A::F widened = A::as_f(A::iand(o.p, A::iset(0xFFFF0000u)));
    o.c = round_stochastic_sum_v<A>(A::sub(c, A::sub(widened, p)), delta, rp, exact);
  } else {
    o.p = round_stochastic_sum_v<A>(p, delta, rp, exact);
  }
  o.m = round_stochastic_v<A>(m, mix32v<A>(A::ixor(lo, k.km)));
  o.v = round_stochastic_v<A>(v, mix32v<A>(A::ixor(lo, k.kv)));
}

// Elements [begin, begin + 2 * LANES * steps); returns where it stopped (the portable loop does the rest).
template <class A, int ROUNDING, bool L2, bool DECOUPLED>
int64_t update_block(uint16_t* __restrict__ P, const uint16_t* __restrict__ G, uint16_t* __restrict__ M,
                     uint16_t* __restrict__ V, uint16_t* __restrict__ C, int64_t begin, int64_t end,
                     const Scalars& s, uint32_t kp, uint32_t km, uint32_t kv, uint32_t lo_offset) {
  constexpr int STEP = 2 * A::LANES;
  const Step<A> k(s, kp, km, kv);
  int64_t i = begin;
  for (; i + STEP <= end; i += STEP) {
    const typename A::I base = A::iset(static_cast<uint32_t>(i) + lo_offset);
    typename A::F pa, pb, ga, gb, ma, mb, va, vb, ca = A::fset(0.0f), cb = A::fset(0.0f);
    A::unpack16(P + i, pa, pb);
    A::unpack16(G + i, ga, gb);
    A::unpack16(M + i, ma, mb);
    A::unpack16(V + i, va, vb);
    if (ROUNDING == 2) A::unpack16(C + i, ca, cb);
    Out<A> oa, ob;
    typename A::Mask exact = A::none();
    update_lanes<A, ROUNDING, L2, DECOUPLED>(oa, pa, ga, ma, va, ca, A::iadd(base, k.iota_a), k, exact);
    update_lanes<A, ROUNDING, L2, DECOUPLED>(ob, pb, gb, mb, vb, cb, A::iadd(base, k.iota_b), k, exact);
    if (ROUNDING != 0 && A::any(exact)) {
      // Rare (1 in 2**14 elements): this step's elements go through the portable loop, which decides them with
      // the exact sum.
      update_portable<ROUNDING, L2, DECOUPLED>(P, G, M, V, C, i, i + STEP, s, kp, km, kv, lo_offset);
      continue;
    }
    A::pack16(P + i, oa.p, ob.p);
    A::pack16(M + i, oa.m, ob.m);
    A::pack16(V + i, oa.v, ob.v);
    if (ROUNDING == 2) A::pack16(C + i, oa.c, ob.c);
  }
  return i;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
using Best = Avx512;
#else
using Best = Avx2;
#endif
}  // namespace simd
#endif

// One block of elements sharing the high 32 bits of their index; ROUNDING: 0 nearest, 1 stochastic, 2 Kahan.
template <int ROUNDING, bool L2, bool DECOUPLED>
void update_block(uint16_t* P, const uint16_t* G, uint16_t* M, uint16_t* V, uint16_t* C, int64_t begin, int64_t end,
                  const Scalars& s, uint32_t kp, uint32_t km, uint32_t kv, uint32_t lo_offset) {
#ifdef PB16_SIMD
  if (vector_loops)
    begin = simd::update_block<simd::Best, ROUNDING, L2, DECOUPLED>(P, G, M, V, C, begin, end, s, kp, km, kv,
                                                                    lo_offset);
#endif
  update_portable<ROUNDING, L2, DECOUPLED>(P, G, M, V, C, begin, end, s, kp, km, kv, lo_offset);
}

template <int ROUNDING, bool L2, bool DECOUPLED>
void update_all(uint16_t* P, const uint16_t* G, uint16_t* M, uint16_t* V, uint16_t* C, int64_t n, const Scalars& s,
                int64_t key_p, int64_t key_m, int64_t key_v, int64_t offset) {
  // Random bits belong to the index in the whole tensor (offset + i); blocks split where its high word changes.
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t global = begin + offset;
      const int64_t block_end = std::min(end, (((global >> 32) + 1) << 32) - offset);
      const uint32_t hi = static_cast<uint32_t>(global >> 32);
      update_block<ROUNDING, L2, DECOUPLED>(P, G, M, V, C, begin, block_end, s,
                                            mix32(static_cast<uint32_t>(key_p) ^ hi),
                                            mix32(static_cast<uint32_t>(key_m) ^ hi),
                                            mix32(static_cast<uint32_t>(key_v) ^ hi),
                                            static_cast<uint32_t>(offset));
      begin = block_end;
    }
  });
}

template <int ROUNDING>
void dispatch_decay(bool l2, bool decoupled, uint16_t* P, const uint16_t* G, uint16_t* M, uint16_t* V, uint16_t* C,
                    int64_t n, const Scalars& s, int64_t kp, int64_t km, int64_t kv, int64_t off) {
  if (l2) return update_all<ROUNDING, true, false>(P, G, M, V, C, n, s, kp, km, kv, off);
  if (decoupled) return update_all<ROUNDING, false, true>(P, G, M, V, C, n, s, kp, km, kv, off);
  update_all<ROUNDING, false, false>(P, G, M, V, C, n, s, kp, km, kv, off);
}

// ---------------------------------------------------------------------------------------------- 8-bit states
// ops/quant.py specifies the codes and explains them; these are its operations, in its order, one rounding each.
PB16_INLINE float uniform24(uint32_t r) { return static_cast<float>(r >> 8) * 5.9604644775390625e-08f; }
PB16_INLINE float level_m_of(float k) { const float t = k / 127.0f; return t * t; }
PB16_INLINE float level_v_of(float k) { const float t = k / 255.0f; const float t2 = t * t; return t2 * t2; }
PB16_INLINE uint16_t bf16_ceil(float x) { return static_cast<uint16_t>(((bits_of(x) + 0xFFFFu) & 0x7FFF0000u) >> 16); }
PB16_INLINE float normalized(float x, float scale) { return scale > 0.0f ? std::fabs(x) / scale : 0.0f; }
// The levels are computed, not looked up: a division vectorizes, a table lookup (a gather) does not.
PB16_INLINE int8_t encode_m(float x, float scale, uint32_t r) {
  const float a = normalized(x, scale);
  const int32_t k0 = std::min(static_cast<int32_t>(std::sqrt(a) * 127.0f), 126);
  const float lo = level_m_of(static_cast<float>(k0)), hi = level_m_of(static_cast<float>(k0) + 1.0f);
  const float frac = std::min(std::max((a - lo) / (hi - lo), 0.0f), 1.0f);
  const int32_t k = k0 + static_cast<int32_t>(uniform24(r) < frac);
  return static_cast<int8_t>(x < 0.0f ? -k : k);
}
PB16_INLINE float decode_m(int8_t code, float scale) {
  const int32_t k = code;
  const float value = scale * level_m_of(static_cast<float>(k < 0 ? -k : k));
  return k < 0 ? -value : value;
}
PB16_INLINE uint8_t encode_v(float x, float scale, uint32_t r) {
  const float a = normalized(x, scale);
  const int32_t k0 = std::min(static_cast<int32_t>(std::sqrt(std::sqrt(a)) * 255.0f), 254);
  const float lo = level_v_of(static_cast<float>(k0)), hi = level_v_of(static_cast<float>(k0) + 1.0f);
  const float frac = std::min(std::max((a - lo) / (hi - lo), 0.0f), 1.0f);
  return static_cast<uint8_t>(k0 + static_cast<int32_t>(uniform24(r) < frac));
}
PB16_INLINE float decode_v(uint8_t code, float scale) { return scale * level_v_of(static_cast<float>(code)); }
// 1/256 of the bf16 spacing of the bf16 weight p: a power of two, normal or subnormal.
PB16_INLINE float residual_unit(uint16_t p) {
  const uint32_t e = std::max<uint32_t>((p >> 7) & 0xFFu, 1u);
  return e >= 16 ? float_of((e - 15u) << 23) : float_of(1u << (std::min<uint32_t>(e, 15u) + 7u));
}
PB16_INLINE int8_t encode_residual(float c, uint16_t p_out, uint32_t r) {
  const float t = c / residual_unit(p_out);
  const float k0 = std::floor(t);
  const float k = k0 + static_cast<float>(uniform24(r) < t - k0);
  return static_cast<int8_t>(std::min(std::max(k, -127.0f), 127.0f));
}

constexpr int64_t QBLOCK = 128;

// Keys of the random bits of one block (its elements share the high word of their index).
struct BlockKeys {
  uint32_t lo0, kp, km, kv;
};

// Scratch of one block: the new moments before encoding, the exact-sum operands of the rare exact decisions.
struct BlockBuffers {
  alignas(64) float m[QBLOCK];
  alignas(64) float v[QBLOCK];
  alignas(64) float a[QBLOCK];
  alignas(64) float d[QBLOCK];
};

// The rare exact decisions (round_stochastic_sum_fast flagged one): the block's stochastically rounded sums, the
// parameter's (or the bf16 Kahan remainder's), decided again from the exact sums of their operands in `buf`.
template <int ROUNDING, typename CT>
void decide_sums_exactly(uint16_t* Pb, CT* Cb, int64_t count, const BlockKeys& key, const BlockBuffers& buf) {
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t r = mix32((key.lo0 + static_cast<uint32_t>(j)) ^ key.kp);
    const uint16_t out = round_stochastic_sum(buf.a[j], buf.d[j], r);
    if constexpr (ROUNDING == 2) reinterpret_cast<uint16_t*>(Cb)[j] = out;
    else Pb[j] = out;
  }
}

// One block of `count` (<= QBLOCK) elements: moments bf16 (MT = VT = uint16_t) or 8-bit (int8_t, uint8_t), the Kahan
// remainder bf16 (CT = uint16_t) or 8-bit (int8_t). The block is decoded and updated (the parameter written), then
// its new scales found and its moments encoded. Typed restrict pointers: no aliasing for the compiler to fear.
template <int ROUNDING, bool L2, bool DECOUPLED, typename MT, typename VT, typename CT>
void update_qblock_portable(uint16_t* __restrict__ Pb, const uint16_t* __restrict__ Gb, MT* __restrict__ Mb,
                            VT* __restrict__ Vb, uint16_t* __restrict__ MSb, uint16_t* __restrict__ VSb,
                            CT* __restrict__ Cb, int64_t count, const Scalars& s, const BlockKeys& key,
                            BlockBuffers& buf) {
  constexpr bool Q8M = sizeof(MT) == 1;
  constexpr bool C8 = sizeof(CT) == 1;
  const uint32_t lo0 = key.lo0, kp = key.kp, km = key.km, kv = key.kv;
  float* __restrict__ mbuf = buf.m;
  float* __restrict__ vbuf = buf.v;
  float* __restrict__ abuf = buf.a;
  float* __restrict__ dbuf = buf.d;
  // Separate simple loops, each of which the compiler can vectorize: decode, update, block maximum, encode.
  if constexpr (Q8M) {
    const float m_scale = widen(*MSb), v_scale = widen(*VSb);
    for (int64_t j = 0; j < count; ++j) {
      mbuf[j] = decode_m(Mb[j], m_scale);
      vbuf[j] = decode_v(Vb[j], v_scale);
    }
  } else {
    for (int64_t j = 0; j < count; ++j) {
      mbuf[j] = widen(Mb[j]);
      vbuf[j] = widen(Vb[j]);
    }
  }
  uint32_t exact = 0;
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    const float p = widen(Pb[j]);
    float g = widen(Gb[j]);
    float m = mbuf[j], v = vbuf[j];
    if (L2) g = g + p * s.wd;
    v = v * s.b2 + (g * g) * s.omb2;
    m = m * s.b1 + g * s.omb1;
    float delta = (m / (std::sqrt(v) * s.inv_bc2 + s.eps)) * s.neg_step;
    if (DECOUPLED) delta = delta - p * s.decay;
    if constexpr (ROUNDING == 2) {
      float c;
      if constexpr (C8) c = static_cast<float>(Cb[j]) * residual_unit(Pb[j]);
      else c = widen(Cb[j]);
      const uint16_t out = round_nearest(p + (delta + c));
      if constexpr (C8) {
        Cb[j] = encode_residual((c - (widen(out) - p)) + delta, out, mix32(lo ^ kp));
      } else {
        abuf[j] = c - (widen(out) - p);
        dbuf[j] = delta;
        Cb[j] = round_stochastic_sum_fast(abuf[j], delta, mix32(lo ^ kp), exact);
      }
      Pb[j] = out;
    } else if constexpr (ROUNDING == 1) {
      abuf[j] = p;
      dbuf[j] = delta;
      Pb[j] = round_stochastic_sum_fast(p, delta, mix32(lo ^ kp), exact);
    } else {
      Pb[j] = round_nearest(p + delta);
    }
    mbuf[j] = m;
    vbuf[j] = v;
  }
  if (exact != 0) decide_sums_exactly<ROUNDING>(Pb, Cb, count, key, buf);  // rare: flagged by the fast rounding
  if constexpr (Q8M) {
    // The largest magnitude as the largest bit pattern with the sign cleared (the same order for finite floats):
    // an integer maximum vectorizes, a float one does not without relaxed NaN rules.
    uint32_t m_max = 0, v_max = 0;
    for (int64_t j = 0; j < count; ++j) {
      m_max = std::max(m_max, bits_of(mbuf[j]) & 0x7FFFFFFFu);
      v_max = std::max(v_max, bits_of(vbuf[j]) & 0x7FFFFFFFu);
    }
    *MSb = bf16_ceil(float_of(m_max));
    *VSb = bf16_ceil(float_of(v_max));
    const float ms = widen(*MSb), vs = widen(*VSb);
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t lo = lo0 + static_cast<uint32_t>(j);
      Mb[j] = encode_m(mbuf[j], ms, mix32(lo ^ km));
      Vb[j] = encode_v(vbuf[j], vs, mix32(lo ^ kv));
    }
  } else if constexpr (ROUNDING == 0) {
    for (int64_t j = 0; j < count; ++j) {
      Mb[j] = round_nearest(mbuf[j]);
      Vb[j] = round_nearest(vbuf[j]);
    }
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t lo = lo0 + static_cast<uint32_t>(j);
      Mb[j] = round_stochastic(mbuf[j], mix32(lo ^ km));
      Vb[j] = round_stochastic(vbuf[j], mix32(lo ^ kv));
    }
  }
}

#ifdef PB16_SIMD
namespace simd {
// The constants of one 8-bit step in vector registers.
template <class A>
struct QStep : AdamConsts<A> {
  typename A::F zero, one, n127, r127, n255, r255, two_m24;
  explicit QStep(const Scalars& s)
      : AdamConsts<A>(s), zero(A::fset(0.0f)), one(A::fset(1.0f)), n127(A::fset(127.0f)),
        r127(A::fset(1.0f / 127.0f)), n255(A::fset(255.0f)), r255(A::fset(1.0f / 255.0f)),
        two_m24(A::fset(5.9604644775390625e-08f)) {}
};

// k / n for whole numbers k in [0, 256) and n = 127 or 255, correctly rounded without a division: the product with
// the rounded reciprocal is off by one unit for some k (8 of the 128 for 127), the remainder k - q * n is exact in one
// fused multiply-add, and the second one corrects q (every k is checked against the division by the tests).
template <class A>
PB16_INLINE typename A::F div_whole(typename A::F k, typename A::F n, typename A::F r) {
  const typename A::F q = A::mul(k, r);
  return A::fmadd(A::fnmadd(q, n, k), r, q);
}
template <class A>
PB16_INLINE typename A::F level_m(typename A::F k, const QStep<A>& c) {
  const typename A::F t = div_whole<A>(k, c.n127, c.r127);
  return A::mul(t, t);
}
template <class A>
PB16_INLINE typename A::F level_v(typename A::F k, const QStep<A>& c) {
  const typename A::F t = div_whole<A>(k, c.n255, c.r255);
  const typename A::F t2 = A::mul(t, t);
  return A::mul(t2, t2);
}
template <class A>
PB16_INLINE typename A::F uniform24(typename A::I r, const QStep<A>& c) {
  return A::mul(A::cvt_f(A::template srli<8>(r)), c.two_m24);
}
// The stochastic choice between levels k0 and k0 + 1 of a normalized magnitude a (encode_m / encode_v).
template <class A, bool V>
PB16_INLINE typename A::I encode_level(typename A::F a, typename A::I r, const QStep<A>& c) {
  const typename A::F root = V ? A::sqrt(A::sqrt(a)) : A::sqrt(a);
  const typename A::I k0 = A::imin(A::cvtt_i(A::mul(root, V ? c.n255 : c.n127)), A::iset(V ? 254 : 126));
  const typename A::F k0f = A::cvt_f(k0);
  const typename A::F lo = V ? level_v<A>(k0f, c) : level_m<A>(k0f, c);
  const typename A::F hi = V ? level_v<A>(A::add(k0f, c.one), c) : level_m<A>(A::add(k0f, c.one), c);
  const typename A::F frac = A::fmin(c.one, A::fmax(c.zero, A::div(A::sub(a, lo), A::sub(hi, lo))));
  return A::add_one_where(A::lt(uniform24<A>(r, c), frac), k0);
}
template <class A>
PB16_INLINE typename A::F normalized(typename A::F x, float scale, typename A::F scale_v, const QStep<A>& c) {
  if (!(scale > 0.0f)) return c.zero;
  return A::div(A::as_f(A::iand(A::as_i(x), A::iset(0x7FFFFFFFu))), scale_v);
}
// The biased exponent (at least 1) of the bf16 words in the high halves of the lanes: it sets their remainder's unit.
template <class A>
PB16_INLINE typename A::I residual_exponent(typename A::I p) {
  return A::imax(A::iand(A::template srli<23>(p), A::iset(0xFFu)), A::iset(1));
}
// residual_unit of the bf16 words in the high halves of the lanes.
template <class A>
PB16_INLINE typename A::F residual_unit_v(typename A::I p) {
  const typename A::I e = residual_exponent<A>(p);
  const typename A::I normal = A::template slli<23>(A::isub(e, A::iset(15)));
  const typename A::I subnormal = A::sllv(A::iset(1), A::iadd(A::imin(e, A::iset(15)), A::iset(7)));
  return A::as_f(A::select(A::at_least(e, A::iset(16)), normal, subnormal));
}

// x / residual_unit of the bf16 words in the high halves of the lanes, without a division: the unit is 2**(e - 142)
// (e the weight's biased exponent, at least 1), so the quotient is x * 2**(142 - e), rounded once as the division
// rounds it. Below e = 16 that factor exceeds the float32 range and is applied in two exact steps (2**64 first).
template <class A>
PB16_INLINE typename A::F div_residual_unit(typename A::F x, typename A::I p) {
  const typename A::I e = residual_exponent<A>(p);
  const typename A::Mask low = A::at_least(A::iset(15), e);
  const typename A::I exponent = A::isub(A::select(low, A::iset(205), A::iset(269)), e);
  const typename A::F first = A::as_f(A::select(low, A::iset(0x5F800000u), A::iset(0x3F800000u)));  // 2**64 or 1
  return A::mul(A::mul(x, first), A::as_f(A::template slli<23>(exponent)));
}

// One full block (QBLOCK elements) in vector registers, LANES a step, the same operations as update_qblock_portable
// lane by lane. The moments go through the block buffers between the update and the encoding (the scales need the
// whole block first).
template <class A, int ROUNDING, bool L2, bool DECOUPLED, typename MT, typename VT, typename CT>
void update_qblock(uint16_t* __restrict__ Pb, const uint16_t* __restrict__ Gb, MT* __restrict__ Mb,
                   VT* __restrict__ Vb, uint16_t* __restrict__ MSb, uint16_t* __restrict__ VSb, CT* __restrict__ Cb,
                   const QStep<A>& c, const BlockKeys& key, BlockBuffers& buf) {
  using F = typename A::F;
  using I = typename A::I;
  constexpr bool Q8M = sizeof(MT) == 1;
  constexpr bool C8 = sizeof(CT) == 1;
  constexpr int L = A::LANES;
  const I kp = A::iset(key.kp), km = A::iset(key.km), kv = A::iset(key.kv), iota = A::iota();
  const I sign = A::iset(0x80000000u), magnitude = A::iset(0x7FFFFFFFu);
  float ms_in = 0.0f, vs_in = 0.0f;
  if constexpr (Q8M) ms_in = widen(*MSb), vs_in = widen(*VSb);
  const F ms_v = A::fset(ms_in), vs_v = A::fset(vs_in);
  I m_max = A::iset(0), v_max = A::iset(0);
  typename A::Mask exact = A::none();
  for (int j = 0; j < QBLOCK; j += L) {
    const I lo = A::iadd(A::iset(key.lo0 + static_cast<uint32_t>(j)), iota);
    const F p = A::widen(Pb + j), g = A::widen(Gb + j);
    F m, v;
    if constexpr (Q8M) {
      const I km8 = A::load_i8(reinterpret_cast<const int8_t*>(Mb) + j);
      const F m_abs = A::mul(ms_v, level_m<A>(A::cvt_f(A::iabs(km8)), c));
      m = A::as_f(A::ixor(A::as_i(m_abs), A::iand(km8, sign)));  // the code's sign
      v = A::mul(vs_v, level_v<A>(A::cvt_f(A::load_u8(reinterpret_cast<const uint8_t*>(Vb) + j)), c));
    } else {
      m = A::widen(reinterpret_cast<const uint16_t*>(Mb) + j);
      v = A::widen(reinterpret_cast<const uint16_t*>(Vb) + j);
    }
    const F delta = adam_delta<A, L2, DECOUPLED>(p, g, m, v, c);
    if constexpr (ROUNDING == 0) {
      A::store_high16(Pb + j, round_nearest_v<A>(A::add(p, delta)));
    } else {
      const I rp = mix32v<A>(A::ixor(lo, kp));
      if constexpr (ROUNDING == 2) {
        F comp;
        if constexpr (C8) {
          comp = A::mul(A::cvt_f(A::load_i8(reinterpret_cast<const int8_t*>(Cb) + j)), residual_unit_v<A>(A::as_i(p)));
        } else {
          comp = A::widen(reinterpret_cast<const uint16_t*>(Cb) + j);
        }
        const I out = round_nearest_v<A>(A::add(p, A::add(delta, comp)));
        const F widened = A::as_f(A::iand(out, A::iset(0xFFFF0000u)));
        const F rest = A::sub(comp, A::sub(widened, p));
        if constexpr (C8) {
          const F t = div_residual_unit<A>(A::add(rest, delta), out);
          const F k0 = A::floor(t);
          const F k = A::selectf(A::lt(uniform24<A>(rp, c), A::sub(t, k0)), A::add(k0, c.one), k0);
          A::store_low8(Cb + j, A::cvtt_i(A::fmin(A::fset(127.0f), A::fmax(A::fset(-127.0f), k))));
        } else {
          A::storef(buf.a + j, rest);
          A::storef(buf.d + j, delta);
          A::store_high16(reinterpret_cast<uint16_t*>(Cb) + j, round_stochastic_sum_v<A>(rest, delta, rp, exact));
        }
        A::store_high16(Pb + j, out);
      } else {
        A::storef(buf.a + j, p);
        A::storef(buf.d + j, delta);
        A::store_high16(Pb + j, round_stochastic_sum_v<A>(p, delta, rp, exact));
      }
    }
    if constexpr (Q8M) {
      A::storef(buf.m + j, m);
      A::storef(buf.v + j, v);
      m_max = A::umax(m_max, A::iand(A::as_i(m), magnitude));
      v_max = A::umax(v_max, A::iand(A::as_i(v), magnitude));
    } else if constexpr (ROUNDING == 0) {
      A::store_high16(reinterpret_cast<uint16_t*>(Mb) + j, round_nearest_v<A>(m));
      A::store_high16(reinterpret_cast<uint16_t*>(Vb) + j, round_nearest_v<A>(v));
    } else {
      A::store_high16(reinterpret_cast<uint16_t*>(Mb) + j, round_stochastic_v<A>(m, mix32v<A>(A::ixor(lo, km))));
      A::store_high16(reinterpret_cast<uint16_t*>(Vb) + j, round_stochastic_v<A>(v, mix32v<A>(A::ixor(lo, kv))));
    }
  }
  if (A::any(exact)) decide_sums_exactly<ROUNDING>(Pb, Cb, QBLOCK, key, buf);  // rare, as in the portable loop
  if constexpr (Q8M) {
    *MSb = bf16_ceil(float_of(A::hmax(m_max)));
    *VSb = bf16_ceil(float_of(A::hmax(v_max)));
    const float ms = widen(*MSb), vs = widen(*VSb);
    const F ms_new = A::fset(ms), vs_new = A::fset(vs);
    for (int j = 0; j < QBLOCK; j += L) {
      const I lo = A::iadd(A::iset(key.lo0 + static_cast<uint32_t>(j)), iota);
      const F m = A::loadf(buf.m + j), v = A::loadf(buf.v + j);
      const I k_m = encode_level<A, false>(normalized<A>(m, ms, ms_new, c), mix32v<A>(A::ixor(lo, km)), c);
      A::store_low8(Mb + j, A::negate_where(A::lt(m, c.zero), k_m));
      A::store_low8(Vb + j, encode_level<A, true>(normalized<A>(v, vs, vs_new, c), mix32v<A>(A::ixor(lo, kv)), c));
    }
  }
}
}  // namespace simd
#endif

// Blocks [qb_begin, qb_end) of QBLOCK elements: full blocks in the vector loop where there is one, the rest portable.
template <int ROUNDING, bool L2, bool DECOUPLED, typename MT, typename VT, typename CT>
void update_blocks_q8(uint16_t* P, const uint16_t* G, MT* M, VT* V, uint16_t* MS, uint16_t* VS, CT* C, int64_t n,
                      int64_t qb_begin, int64_t qb_end, const Scalars& s, int64_t key_p, int64_t key_m,
                      int64_t key_v, int64_t offset) {
  BlockBuffers buf;
#ifdef PB16_SIMD
  const simd::QStep<simd::Best> consts(s);
  const bool vector = vector_loops;
#endif
  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    const int64_t begin = qb * QBLOCK, count = std::min(QBLOCK, n - begin);
    const int64_t global = begin + offset;  // offset is a multiple of QBLOCK: one high index word per block
    const uint32_t hi = static_cast<uint32_t>(global >> 32);
    const BlockKeys key{static_cast<uint32_t>(global), mix32(static_cast<uint32_t>(key_p) ^ hi),
                        mix32(static_cast<uint32_t>(key_m) ^ hi), mix32(static_cast<uint32_t>(key_v) ^ hi)};
    uint16_t* MSb = MS != nullptr ? MS + qb : nullptr;  // bf16 moments have no scales
    uint16_t* VSb = VS != nullptr ? VS + qb : nullptr;
    CT* Cb = ROUNDING == 2 ? C + begin : nullptr;
#ifdef PB16_SIMD
    if (vector && count == QBLOCK) {
      simd::update_qblock<simd::Best, ROUNDING, L2, DECOUPLED, MT, VT, CT>(P + begin, G + begin, M + begin, V + begin,
                                                                           MSb, VSb, Cb, consts, key, buf);
      continue;
    }
#endif
    update_qblock_portable<ROUNDING, L2, DECOUPLED, MT, VT, CT>(P + begin, G + begin, M + begin, V + begin, MSb, VSb,
                                                                Cb, count, s, key, buf);
  }
}

template <int ROUNDING, typename MT, typename VT, typename CT>
void dispatch_q8(bool l2, bool dec, uint16_t* P, const uint16_t* G, void* Mv, void* Vv, uint16_t* MS, uint16_t* VS,
                 void* Cv, int64_t n, const Scalars& s, int64_t kp, int64_t km, int64_t kv, int64_t off) {
  MT* M = static_cast<MT*>(Mv);
  VT* V = static_cast<VT*>(Vv);
  CT* C = static_cast<CT*>(Cv);
  const int64_t blocks = (n + QBLOCK - 1) / QBLOCK;
  at::parallel_for(0, blocks, 128, [&](int64_t b0, int64_t b1) {
#define PB16_BLOCKS(L2_, DEC_) \
  update_blocks_q8<ROUNDING, L2_, DEC_, MT, VT, CT>(P, G, M, V, MS, VS, C, n, b0, b1, s, kp, km, kv, off)
    if (l2) PB16_BLOCKS(true, false);
    else if (dec) PB16_BLOCKS(false, true);
    else PB16_BLOCKS(false, false);
#undef PB16_BLOCKS
  });
}

void adamw_update_q8(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                     torch::Tensor exp_avg_scale, torch::Tensor exp_avg_sq_scale, torch::Tensor kahan_comp,
                     int64_t rounding, bool decoupled, double beta1, double one_minus_beta1, double beta2,
                     double one_minus_beta2, double eps, double weight_decay, double decay, double neg_step_size,
                     double inv_bias_correction2_sqrt, int64_t key_p, int64_t key_m, int64_t key_v,
                     int64_t index_offset) {
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "adamw_update_q8: rounding code ", rounding, " is not 0, 1 or 2");
  TORCH_CHECK(index_offset >= 0 && index_offset % QBLOCK == 0, "adamw_update_q8: index_offset must be a multiple of ",
              QBLOCK, ", got ", index_offset);
  const int64_t n = param.numel();
  const bool q8m = exp_avg.scalar_type() == at::kChar;
  const bool c8 = rounding == 2 && kahan_comp.scalar_type() == at::kChar;
  TORCH_CHECK(q8m || c8, "adamw_update_q8: no 8-bit state given");
  TORCH_CHECK(param.scalar_type() == at::kBFloat16 && grad.scalar_type() == at::kBFloat16,
              "adamw_update_q8: `param` and `grad` must be bfloat16");
  TORCH_CHECK(!q8m || exp_avg_sq.scalar_type() == at::kByte, "adamw_update_q8: `exp_avg_sq` must be uint8");
  TORCH_CHECK(q8m || (exp_avg.scalar_type() == at::kBFloat16 && exp_avg_sq.scalar_type() == at::kBFloat16),
              "adamw_update_q8: bf16 moments expected");
  const int64_t blocks = (n + QBLOCK - 1) / QBLOCK;
  const std::pair<const char*, const torch::Tensor*> buffers[] = {
      {"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq},
      {"exp_avg_scale", &exp_avg_scale}, {"exp_avg_sq_scale", &exp_avg_sq_scale}, {"kahan_comp", &kahan_comp}};
  for (const auto& [name, t] : buffers) {
    const std::string key(name);
    if (rounding != 2 && key == "kahan_comp") continue;
    const bool scale = key == "exp_avg_scale" || key == "exp_avg_sq_scale";
    if (scale && !q8m) continue;
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "adamw_update_q8: `", name,
                "` must be a contiguous CPU tensor");
    TORCH_CHECK(t->numel() == (scale ? blocks : n), "adamw_update_q8: `", name, "` has ", t->numel(),
                " elements, expected ", scale ? blocks : n);
    if (scale) TORCH_CHECK(t->scalar_type() == at::kBFloat16, "adamw_update_q8: `", name, "` must be bfloat16");
  }
  uint16_t* P = reinterpret_cast<uint16_t*>(param.data_ptr());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(grad.data_ptr());
  uint16_t* MS = q8m ? reinterpret_cast<uint16_t*>(exp_avg_scale.data_ptr()) : nullptr;
  uint16_t* VS = q8m ? reinterpret_cast<uint16_t*>(exp_avg_sq_scale.data_ptr()) : nullptr;
  void* C = rounding == 2 ? kahan_comp.data_ptr() : nullptr;
  const Scalars s{static_cast<float>(beta1), static_cast<float>(one_minus_beta1), static_cast<float>(beta2),
                  static_cast<float>(one_minus_beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                  static_cast<float>(decay), static_cast<float>(neg_step_size),
                  static_cast<float>(inv_bias_correction2_sqrt)};
  const bool l2 = !decoupled && weight_decay != 0.0, dec = decoupled && decay != 0.0;
  void* M = exp_avg.data_ptr();
  void* V = exp_avg_sq.data_ptr();
#define PB16_Q8(R, MT, VT, CT) \
  dispatch_q8<R, MT, VT, CT>(l2, dec, P, G, M, V, MS, VS, C, n, s, key_p, key_m, key_v, index_offset)
  if (rounding == 0) PB16_Q8(0, int8_t, uint8_t, uint16_t);
  else if (rounding == 1) PB16_Q8(1, int8_t, uint8_t, uint16_t);
  else if (q8m && c8) PB16_Q8(2, int8_t, uint8_t, int8_t);
  else if (q8m) PB16_Q8(2, int8_t, uint8_t, uint16_t);
  else PB16_Q8(2, uint16_t, uint16_t, int8_t);
#undef PB16_Q8
}

// Stochastic rounding of exact sums on its own, through the loops' paths: a and b float32, bits int32 (tests).
torch::Tensor stochastic_round_sum_bf16(torch::Tensor a, torch::Tensor b, torch::Tensor bits) {
  const int64_t n = a.numel();
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && bits.scalar_type() == at::kInt,
              "stochastic_round_sum_bf16: needs float32 a and b and int32 bits");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && bits.device().is_cpu() && a.is_contiguous() &&
                  b.is_contiguous() && bits.is_contiguous() && b.numel() == n && bits.numel() == n,
              "stochastic_round_sum_bf16: needs contiguous CPU tensors of one size");
  torch::Tensor out = torch::empty({n}, a.options().dtype(at::kBFloat16));
  const float* A = a.data_ptr<float>();
  const float* B = b.data_ptr<float>();
  const uint32_t* R = reinterpret_cast<const uint32_t*>(bits.data_ptr());
  uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr());
  int64_t i = 0;
#ifdef PB16_SIMD
  using S = simd::Best;
  for (; vector_loops && i + S::LANES <= n; i += S::LANES) {
    S::Mask exact = S::none();
    const S::I res = simd::round_stochastic_sum_v<S>(S::loadf(A + i), S::loadf(B + i), S::loadi(R + i), exact);
    S::store_high16(O + i, res);
    if (S::any(exact))
      for (int j = 0; j < S::LANES; ++j) O[i + j] = round_stochastic_sum(A[i + j], B[i + j], R[i + j]);
  }
#endif
  for (; i < n; i += CHUNK) {
    const int64_t cn = std::min(CHUNK, n - i);
    uint32_t exact = 0;
    for (int64_t j = 0; j < cn; ++j) O[i + j] = round_stochastic_sum_fast(A[i + j], B[i + j], R[i + j], exact);
    if (exact != 0)
      for (int64_t j = 0; j < cn; ++j) O[i + j] = round_stochastic_sum(A[i + j], B[i + j], R[i + j]);
  }
  return out;
}

// The levels of the 8-bit codes as the loops compute them: (k / 127)**2 for k < 128, then (k / 255)**4 for k < 256
// (tests: the vector loops' divisions without a divider against the division).
torch::Tensor levels_8bit() {
  torch::Tensor out = torch::empty({128 + 256}, torch::kFloat);
  float* o = out.data_ptr<float>();
#ifdef PB16_SIMD
  using S = simd::Best;
  if (vector_loops) {
    const simd::QStep<S> c(Scalars{});
    for (int k = 0; k < 128; k += S::LANES)
      S::storef(o + k, simd::level_m<S>(S::cvt_f(S::iadd(S::iset(k), S::iota())), c));
    for (int k = 0; k < 256; k += S::LANES)
      S::storef(o + 128 + k, simd::level_v<S>(S::cvt_f(S::iadd(S::iset(k), S::iota())), c));
    return out;
  }
#endif
  for (int k = 0; k < 128; ++k) o[k] = level_m_of(static_cast<float>(k));
  for (int k = 0; k < 256; ++k) o[128 + k] = level_v_of(static_cast<float>(k));
  return out;
}

// Switches the explicit vector loops on or off; returns whether this build has them (tests).
bool use_vector_loops(bool on) {
  vector_loops = on;
#ifdef PB16_SIMD
  return true;
#else
  return false;
#endif
}

// Whether any element is inf or NaN (exponent bits all ones): one read-only pass, an OR-reduction that vectorizes.
bool any_nonfinite_bf16(torch::Tensor t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              "any_nonfinite_bf16: needs a contiguous bfloat16 CPU tensor");
  const uint16_t* x = reinterpret_cast<const uint16_t*>(t.data_ptr());
  std::atomic<bool> found{false};
  at::parallel_for(0, t.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    // An all-ones exponent plus one exponent step carries into bit 15; any other exponent does not.
    uint32_t acc = 0;
    for (int64_t i = begin; i < end; ++i) acc |= (x[i] & 0x7F80u) + 0x0080u;
    if (acc & 0x8000u) found = true;
  });
  return found;
}

void adamw_update_bf16(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                       torch::Tensor kahan_comp, int64_t rounding, bool decoupled, double beta1, double one_minus_beta1,
                       double beta2, double one_minus_beta2, double eps, double weight_decay, double decay,
                       double neg_step_size, double inv_bias_correction2_sqrt, int64_t key_p, int64_t key_m,
                       int64_t key_v, int64_t index_offset) {
  // The loop reads raw bf16 words: every buffer must be a contiguous bf16 CPU tensor of the parameter's size.
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "adamw_update_bf16: rounding code ", rounding, " is not 0, 1 or 2");
  TORCH_CHECK(index_offset >= 0, "adamw_update_bf16: index_offset must be >= 0, got ", index_offset);
  const int64_t numel = param.numel();
  const std::pair<const char*, const torch::Tensor*> buffers[] = {{"param", &param},
                                                                   {"grad", &grad},
                                                                   {"exp_avg", &exp_avg},
                                                                   {"exp_avg_sq", &exp_avg_sq},
                                                                   {"kahan_comp", &kahan_comp}};
  for (const auto& [name, t] : buffers) {
    if (rounding != 2 && std::string(name) == "kahan_comp") continue;
    TORCH_CHECK(t->device().is_cpu(), "adamw_update_bf16: `", name, "` must be a CPU tensor, got ", t->device());
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "adamw_update_bf16: `", name, "` must be bfloat16, got ",
                t->scalar_type());
    TORCH_CHECK(t->is_contiguous(), "adamw_update_bf16: `", name, "` must be contiguous");
    TORCH_CHECK(t->numel() == numel, "adamw_update_bf16: `", name, "` has ", t->numel(), " elements, the parameter ",
                numel);
  }
  uint16_t* P = reinterpret_cast<uint16_t*>(param.data_ptr());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(grad.data_ptr());
  uint16_t* M = reinterpret_cast<uint16_t*>(exp_avg.data_ptr());
  uint16_t* V = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr());
  // Only Kahan reads the compensation buffer (the caller passes a placeholder otherwise).
  uint16_t* C = rounding == 2 ? reinterpret_cast<uint16_t*>(kahan_comp.data_ptr()) : nullptr;
  // Scalars become float32 exactly as torch turns a Python float into the scalar of a float32 tensor op.
  const Scalars s{static_cast<float>(beta1), static_cast<float>(one_minus_beta1), static_cast<float>(beta2),
                  static_cast<float>(one_minus_beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                  static_cast<float>(decay), static_cast<float>(neg_step_size),
                  static_cast<float>(inv_bias_correction2_sqrt)};
  const bool l2 = !decoupled && weight_decay != 0.0, dec = decoupled && decay != 0.0;
  const int64_t n = param.numel();
  if (rounding == 0) dispatch_decay<0>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
  else if (rounding == 1) dispatch_decay<1>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
  else dispatch_decay<2>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
}
"""

_extension: Any = None
_failure: str | None = None


def _source() -> str:
    defines = {
        "MIX_MUL1": f"{rng.MIX_MUL1:#x}u",
        "MIX_MUL2": f"{rng.MIX_MUL2:#x}u",
        "MIX_SHIFT1": str(rng.MIX_SHIFT1),
        "MIX_SHIFT2": str(rng.MIX_SHIFT2),
        "MIX_SHIFT3": str(rng.MIX_SHIFT3),
    }
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE


def fused_cpu_available() -> bool:
    """Whether the fused CPU loop compiled (it is compiled on the first call; a failure is reported once)."""
    global _extension, _failure
    if _extension is None and _failure is None:
        from torch.utils.cpp_extension import load_inline

        # Vector instructions of the CPU torch itself dispatches to; part of the name, so each build is cached apart.
        # FMA too: ATen reports AVX2 only for CPUs that also have FMA3, and every AVX-512 CPU has it (the 8-bit vector
        # loop uses explicit fused multiply-adds; the compiler still contracts nothing by itself).
        # No fused multiply-add contraction: every product is rounded, as in the PyTorch path. The random bits belong
        # to each element's index, so any split over threads writes the same bytes.
        capability = torch.backends.cpu.get_cpu_capability()
        arch = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]}.get(
            capability, []
        )
        flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", *arch]
        # With OpenMP, as torch itself is built, at::parallel_for splits the loop over torch's threads (without it,
        # ATen's inline parallel_for runs serially in an extension); a compiler without OpenMP builds the serial loop.
        for suffix, openmp in (("", ["-fopenmp"]), ("_serial", [])):
            try:
                _extension = load_inline(
                    name=f"lightning_pure_bf16_adamw_cpu_v21_{capability.lower()}{suffix}",
                    cpp_sources=[_source()],
                    functions=[
                        "adamw_update_bf16",
                        "adamw_update_q8",
                        "any_nonfinite_bf16",
                        "levels_8bit",
                        "stochastic_round_sum_bf16",
                        "use_vector_loops",
                    ],
                    extra_cflags=[*flags, *openmp],
                    extra_ldflags=openmp,
                    verbose=False,
                )
                break
            except Exception as err:  # noqa: BLE001 - any build failure means: try the next, then the PyTorch path
                _failure = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else err}"
        if _extension is not None:
            _failure = None
        else:
            warnings.warn(
                f"lightning_pure_bf16: the fused CPU optimizer loop did not compile ({_failure}); using the slower"
                " PyTorch path. It needs a C++ compiler and ninja (`pip install ninja`).",
                RuntimeWarning,
                stacklevel=3,
            )
    return _extension is not None


def can_use_fused_cpu(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether a parameter and its gradient suit the fused CPU loop: bf16 on the CPU, contiguous (the optimizer's own
    state buffers are created so)."""
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in (param, grad))


def any_nonfinite_cpu(grad: torch.Tensor) -> bool:
    """Whether a contiguous bf16 CPU tensor holds an inf or NaN (one pass; the fused loop must be available)."""
    return grad.numel() > 0 and bool(_extension.any_nonfinite_bf16(grad))


def adamw_update_cpu_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    kahan_comp: torch.Tensor | None,
    args: UpdateArgs,
    *,
    index_offset: int = 0,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW step in place, one pass; same contract and bits as ``adamw_update_torch_`` (bf16, CPU),
    8-bit states included.

    ``index_offset``: index of the first element in the whole tensor when the buffers are one piece of it.
    """
    if param.numel() == 0:
        return
    # The step's scalars, the same for both loops; the loops ignore the placeholders of absent buffers.
    step = (_ROUNDING_CODES[args.rounding], args.decoupled, *args.scalars, *args.keys, index_offset)
    comp = kahan_comp if kahan_comp is not None else param
    if exp_avg_scale is not None or comp.dtype == torch.int8:
        m_scale = exp_avg_scale if exp_avg_scale is not None else param
        v_scale = exp_avg_sq_scale if exp_avg_sq_scale is not None else param
        _extension.adamw_update_q8(param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, comp, *step)
    else:
        _extension.adamw_update_bf16(param, grad, exp_avg, exp_avg_sq, comp, *step)


__all__ = ["adamw_update_cpu_", "any_nonfinite_cpu", "can_use_fused_cpu", "fused_cpu_available"]
