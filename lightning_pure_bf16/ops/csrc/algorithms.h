// The float32 arithmetic of one element's update for the algorithms of the family that run in the generic loop
// (elementwise.cpp): the same operations in the same order as ops/algorithms.py and ops/update_triton.py, so every
// backend writes the same bits. Adam's arithmetic lives in its own hand-vectorized loops (update_bf16.h, q8.h).
#pragma once

#include "rounding.h"

// An algorithm's float scalars (ops.algorithms.hyper_scalars: nine, zero-padded). Each algorithm is a struct templated
// on its variant bits (ops.algorithms: `variant`), so the loop has no branch on them.
struct Hyper {
  float h[9];
  float grad_scale;
};

// Lion (lion-pytorch): h = beta1, 1 - beta1, beta2, 1 - beta2, -lr, lr * weight_decay; variant 1: weight decay.
template <int VARIANT>
struct Lion {
  static constexpr int STATES = 1;
  static PB16_INLINE float step(float p, float g, float& m, const Hyper& s) {
    const float c = m * s.h[0] + g * s.h[1];
    m = m * s.h[2] + g * s.h[3];
    // The sign as a select: 0 for 0 and NaN, as in every backend.
    float delta = (c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f)) * s.h[4];
    if constexpr ((VARIANT & 1) != 0) delta = delta - p * s.h[5];
    return delta;
  }
};

// SGD (torch.optim.SGD): h = weight_decay, keep, take, momentum, -lr (keep = 0, take = 1 at the first step: the
// buffer starts at the gradient); variant bit 0: L2 weight decay, bit 1: Nesterov. STATES 0: no momentum.
template <int STATES_, int VARIANT>
struct Sgd {
  static constexpr int STATES = STATES_;
  static PB16_INLINE float step(float p, float g, float& buf, const Hyper& s) {
    if constexpr ((VARIANT & 1) != 0) g = g + p * s.h[0];
    float d = g;
    if constexpr (STATES == 1) {
      buf = buf * s.h[1] + g * s.h[2];
      if constexpr ((VARIANT & 2) != 0) d = g + buf * s.h[3];
      else d = buf;
    }
    return d * s.h[4];
  }
};

// The write of a direction computed beforehand from whole matrices (Muon's orthogonalized momentum), handed as the
// gradient: h = -step_size, lr * weight_decay; variant 1: decoupled weight decay. No state.
template <int VARIANT>
struct Direction {
  static constexpr int STATES = 0;
  static PB16_INLINE float step(float p, float g, float& /*unused*/, const Hyper& s) {
    float delta = g * s.h[0];
    if constexpr ((VARIANT & 1) != 0) delta = delta - p * s.h[1];
    return delta;
  }
};
