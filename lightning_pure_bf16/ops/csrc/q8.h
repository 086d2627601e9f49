// 8-bit states: the codes' scalar operations, the block loops (portable and vector) and their dispatch.
#pragma once

#include "update_bf16.h"

// ops/quant.py specifies the codes and explains them; these are its operations, in its order, one rounding each.
PB16_INLINE float uniform24(uint32_t r) { return static_cast<float>(r >> 8) * 5.9604644775390625e-08f; }
PB16_INLINE float level_m_of(float k) {
  const float t = k / 127.0f;
  return t * t;
}
PB16_INLINE float level_v_of(float k) {
  const float t = k / 255.0f;
  const float t2 = t * t;
  return t2 * t2;
}
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
    if (s.grad_scale != 1.0f) g = g * s.grad_scale;
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
      const uint32_t r = mix32(lo ^ km);  // one word for both moments: m its low half, v its high half
      Mb[j] = round_stochastic(mbuf[j], r);
      Vb[j] = round_stochastic(vbuf[j], r >> 16);
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
      : AdamConsts<A>(s),
        zero(A::fset(0.0f)),
        one(A::fset(1.0f)),
        n127(A::fset(127.0f)),
        r127(A::fset(1.0f / 127.0f)),
        n255(A::fset(255.0f)),
        r255(A::fset(1.0f / 255.0f)),
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
void update_qblock(uint16_t* __restrict__ Pb, const uint16_t* __restrict__ Gb, MT* __restrict__ Mb, VT* __restrict__ Vb,
                   uint16_t* __restrict__ MSb, uint16_t* __restrict__ VSb, CT* __restrict__ Cb, const QStep<A>& c,
                   const BlockKeys& key, BlockBuffers& buf) {
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
      const I r = mix32v<A>(A::ixor(lo, km));  // one word for both moments: m its low half, v its high half
      A::store_high16(reinterpret_cast<uint16_t*>(Mb) + j, round_stochastic_v<A>(m, r));
      A::store_high16(reinterpret_cast<uint16_t*>(Vb) + j, round_stochastic_v<A>(v, A::template srli<16>(r)));
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
                      int64_t qb_begin, int64_t qb_end, const Scalars& s, int64_t key_p, int64_t key_m, int64_t key_v,
                      int64_t offset) {
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
