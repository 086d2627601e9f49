// The explicit vector loop of the bf16-state update: one template, two sets of instructions (AVX-512, AVX2).
#pragma once

#include "rounding.h"

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
  static PB16_INLINE I srli(I a) {
    return _mm512_srli_epi32(a, N);
  }
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
    return as_f(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
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
  static PB16_INLINE I slli(I a) {
    return _mm512_slli_epi32(a, N);
  }
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
  static PB16_INLINE I srli(I a) {
    return _mm256_srli_epi32(a, N);
  }
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
    const I bytes =
        _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
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
  static PB16_INLINE I slli(I a) {
    return _mm256_slli_epi32(a, N);
  }
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
  typename A::F b1, omb1, b2, omb2, eps, wd, decay, neg_step, inv_bc2, grad_scale;
  bool scale_grad;
  explicit AdamConsts(const Scalars& s)
      : b1(A::fset(s.b1)),
        omb1(A::fset(s.omb1)),
        b2(A::fset(s.b2)),
        omb2(A::fset(s.omb2)),
        eps(A::fset(s.eps)),
        wd(A::fset(s.wd)),
        decay(A::fset(s.decay)),
        neg_step(A::fset(s.neg_step)),
        inv_bc2(A::fset(s.inv_bc2)),
        grad_scale(A::fset(s.grad_scale)),
        scale_grad(s.grad_scale != 1.0f) {}
};
template <class A, bool L2, bool DECOUPLED>
PB16_INLINE typename A::F adam_delta(typename A::F p, typename A::F g, typename A::F& m, typename A::F& v,
                                     const AdamConsts<A>& k) {
  if (k.scale_grad) g = A::mul(g, k.grad_scale);
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
      : AdamConsts<A>(s),
        iota_a(A::iota_a()),
        iota_b(A::iota_b()),
        kp(A::iset(kp_)),
        km(A::iset(km_)),
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
  const typename A::I r = mix32v<A>(A::ixor(lo, k.km));  // one word for both moments: m its low half, v its high
  o.m = round_stochastic_v<A>(m, r);
  o.v = round_stochastic_v<A>(v, A::template srli<16>(r));
}

// Elements [begin, begin + 2 * LANES * steps); returns where it stopped (the portable loop does the rest).
template <class A, int ROUNDING, bool L2, bool DECOUPLED>
int64_t update_block(uint16_t* __restrict__ P, const uint16_t* __restrict__ G, uint16_t* __restrict__ M,
                     uint16_t* __restrict__ V, uint16_t* __restrict__ C, int64_t begin, int64_t end, const Scalars& s,
                     uint32_t kp, uint32_t km, uint32_t kv, uint32_t lo_offset) {
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
