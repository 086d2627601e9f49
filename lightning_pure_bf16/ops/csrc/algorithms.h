// The float32 arithmetic of one element's update for the algorithms of the family that run in the generic loop
// (elementwise.cpp): the same operations in the same order as ops/algorithms.py and ops/update_triton.py, so every
// backend writes the same bits. Adam's arithmetic lives in its own hand-vectorized loops (update_bf16.h, q8.h).
#pragma once

#include "rounding.h"

// An algorithm's float scalars (ops.algorithms.hyper_scalars: nine, zero-padded) and its compile-time variant bits.
struct Hyper {
  float h[9];
  float grad_scale;
  int variant;
};

// Lion (lion-pytorch): h = beta1, 1 - beta1, beta2, 1 - beta2, -lr, lr * weight_decay; variant 1: weight decay.
struct Lion {
  static PB16_INLINE float step(float p, float g, float& m, const Hyper& s) {
    const float c = m * s.h[0] + g * s.h[1];
    m = m * s.h[2] + g * s.h[3];
    // The sign as a select: 0 for 0 and NaN, as in every backend.
    float delta = (c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f)) * s.h[4];
    if (s.variant & 1) delta = delta - p * s.h[5];
    return delta;
  }
};

// SGD (torch.optim.SGD): h = weight_decay, keep, take, momentum, -lr (keep = 0, take = 1 at the first step: the
// buffer starts at the gradient); variant bit 0: L2 weight decay, bit 1: Nesterov. STATES 0: no momentum.
template <int STATES>
struct Sgd {
  static PB16_INLINE float step(float p, float g, float& buf, const Hyper& s) {
    if (s.variant & 1) g = g + p * s.h[0];
    float d = g;
    if constexpr (STATES == 1) {
      buf = buf * s.h[1] + g * s.h[2];
      d = (s.variant & 2) ? g + buf * s.h[3] : buf;
    }
    return d * s.h[4];
  }
};
