// The bf16-state update over a whole tensor: blocks by the index's high word, the vector loop where the build has
// one, the portable loop for the rest, split over torch's threads.
#pragma once

#include "portable.h"
#include "simd.h"

// One block of elements sharing the high 32 bits of their index; ROUNDING: 0 nearest, 1 stochastic, 2 Kahan.
template <int ROUNDING, bool L2, bool DECOUPLED>
void update_block(uint16_t* P, const uint16_t* G, uint16_t* M, uint16_t* V, uint16_t* C, int64_t begin, int64_t end,
                  const Scalars& s, uint32_t kp, uint32_t km, uint32_t kv, uint32_t lo_offset) {
#ifdef PB16_SIMD
  if (vector_loops)
    begin =
        simd::update_block<simd::Best, ROUNDING, L2, DECOUPLED>(P, G, M, V, C, begin, end, s, kp, km, kv, lo_offset);
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
                                            mix32(static_cast<uint32_t>(key_v) ^ hi), static_cast<uint32_t>(offset));
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
