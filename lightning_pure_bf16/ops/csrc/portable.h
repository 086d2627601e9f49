// The portable loop of the bf16-state update: the compiler vectorizes it.
#pragma once

#include "rounding.h"

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
      if (s.grad_scale != 1.0f) g = g * s.grad_scale;
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
        const uint32_t r = mix32(lo ^ km);  // one word for both moments: m its low half, v its high half
        Mc[j] = round_stochastic(m, r);
        Vc[j] = round_stochastic(v, r >> 16);
      }
    }
    if (ROUNDING != 0 && exact != 0) {
      uint16_t* __restrict__ target = ROUNDING == 2 ? Cc : Pc;
      for (int64_t j = 0; j < cn; ++j)
        target[j] = round_stochastic_sum(abuf[j], bbuf[j], mix32((lo0 + static_cast<uint32_t>(j)) ^ kp));
    }
  }
}
