// The generic loop of the update: any algorithm of algorithms.h with at most one state per element, its state bf16
// or 8-bit (int8 codes, a bf16 scale per block), the weight written with stochastic rounding, Kahan (bf16 or 8-bit
// remainder) or to nearest. Portable code the compiler vectorizes, block by block of QBLOCK elements; the weight's
// stochastic write decides from the exact sum for every element (round_stochastic_sum), so its bits are the
// PyTorch path's without a second pass.
#include "algorithms.h"
#include "q8.h"
#include "update_cpu.h"

namespace {

// The random words of elements [begin, begin + count) for the streams keyed kp (the weight) and km (the state):
// the index's high word folded into each key, per element where the block crosses a multiple of 2**32.
struct Words {
  uint32_t p[QBLOCK];
  uint32_t m[QBLOCK];
};

PB16_INLINE void words_of(Words& w, int64_t global, int64_t count, uint32_t key_p, uint32_t key_m) {
  const uint32_t hi0 = static_cast<uint32_t>(global >> 32);
  const uint32_t kp0 = mix32(key_p ^ hi0), km0 = mix32(key_m ^ hi0);
  const bool one_word = ((global + count - 1) >> 32) == (global >> 32);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t index = global + j;
    const uint32_t lo = static_cast<uint32_t>(index);
    uint32_t kp = kp0, km = km0;
    if (!one_word) {
      const uint32_t hi = static_cast<uint32_t>(index >> 32);
      kp = mix32(key_p ^ hi);
      km = mix32(key_m ^ hi);
    }
    w.p[j] = mix32(lo ^ kp);
    w.m[j] = mix32(lo ^ km);
  }
}

// FORMAT: 0 no state, 1 a bf16 state, 2 an 8-bit state; CT: the Kahan remainder's type (uint16_t bf16, int8_t).
template <class A, int ROUNDING, int FORMAT, typename CT>
void update_block(uint16_t* __restrict__ P, const uint16_t* __restrict__ G, void* S, uint16_t* SS, CT* __restrict__ C,
                  int64_t count, const Hyper& s, const Words& w) {
  float state[QBLOCK];
  if constexpr (FORMAT == 1) {
    const uint16_t* Sb = static_cast<const uint16_t*>(S);
    for (int64_t j = 0; j < count; ++j) state[j] = widen(Sb[j]);
  } else if constexpr (FORMAT == 2) {
    const int8_t* Sq = static_cast<const int8_t*>(S);
    const float scale = widen(*SS);
    for (int64_t j = 0; j < count; ++j) state[j] = decode_m(Sq[j], scale);
  } else {
    for (int64_t j = 0; j < count; ++j) state[j] = 0.0f;
  }
  for (int64_t j = 0; j < count; ++j) {
    const float p = widen(P[j]);
    float g = widen(G[j]);
    if (s.grad_scale != 1.0f) g = g * s.grad_scale;
    const float delta = A::step(p, g, state[j], s);
    if constexpr (ROUNDING == 2) {
      float c;
      if constexpr (sizeof(CT) == 1) c = static_cast<float>(C[j]) * residual_unit(P[j]);
      else c = widen(C[j]);
      const uint16_t out = round_nearest(p + (delta + c));
      // The new remainder: the old one, less what the write took, plus the update (see the PyTorch path).
      if constexpr (sizeof(CT) == 1) C[j] = encode_residual((c - (widen(out) - p)) + delta, out, w.p[j]);
      else C[j] = round_stochastic_sum(c - (widen(out) - p), delta, w.p[j]);
      P[j] = out;
    } else if constexpr (ROUNDING == 1) {
      P[j] = round_stochastic_sum(p, delta, w.p[j]);
    } else {
      P[j] = round_nearest(p + delta);
    }
  }
  if constexpr (FORMAT == 1) {
    uint16_t* Sb = static_cast<uint16_t*>(S);
    for (int64_t j = 0; j < count; ++j)
      Sb[j] = ROUNDING == 0 ? round_nearest(state[j]) : round_stochastic(state[j], w.m[j]);
  } else if constexpr (FORMAT == 2) {
    // The block's scale from its largest magnitude (the largest pattern with the sign cleared), then the codes.
    uint32_t most = 0;
    for (int64_t j = 0; j < count; ++j) most = std::max(most, bits_of(state[j]) & 0x7FFFFFFFu);
    *SS = bf16_ceil(float_of(most));
    const float scale = widen(*SS);
    int8_t* Sq = static_cast<int8_t*>(S);
    for (int64_t j = 0; j < count; ++j) Sq[j] = encode_m(state[j], scale, w.m[j]);
  }
}

template <class A, int ROUNDING, int FORMAT, typename CT>
void update_all(uint16_t* P, const uint16_t* G, void* S, uint16_t* SS, void* C, int64_t n, const Hyper& s,
                int64_t key_p, int64_t key_m, int64_t offset) {
  const int64_t blocks = (n + QBLOCK - 1) / QBLOCK;
  const size_t state_size = FORMAT == 2 ? 1 : 2;
  at::parallel_for(0, blocks, 128, [&](int64_t b0, int64_t b1) {
    Words w;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * QBLOCK, count = std::min(QBLOCK, n - begin);
      words_of(w, offset + begin, count, static_cast<uint32_t>(key_p), static_cast<uint32_t>(key_m));
      void* Sb = FORMAT == 0 ? nullptr : static_cast<char*>(S) + begin * state_size;
      CT* Cb = ROUNDING == 2 ? static_cast<CT*>(C) + begin : nullptr;
      update_block<A, ROUNDING, FORMAT, CT>(P + begin, G + begin, Sb, FORMAT == 2 ? SS + b : nullptr, Cb, count, s, w);
    }
  });
}

template <class A, int FORMAT>
void dispatch_rounding(int64_t rounding, bool c8, uint16_t* P, const uint16_t* G, void* S, uint16_t* SS, void* C,
                       int64_t n, const Hyper& s, int64_t kp, int64_t km, int64_t off) {
  if (rounding == 0) update_all<A, 0, FORMAT, uint16_t>(P, G, S, SS, C, n, s, kp, km, off);
  else if (rounding == 1) update_all<A, 1, FORMAT, uint16_t>(P, G, S, SS, C, n, s, kp, km, off);
  else if (c8) update_all<A, 2, FORMAT, int8_t>(P, G, S, SS, C, n, s, kp, km, off);
  else update_all<A, 2, FORMAT, uint16_t>(P, G, S, SS, C, n, s, kp, km, off);
}

void check_buffer(const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(!t.key_set().has(c10::DispatchKey::Python) && t.has_storage() && (t.numel() == 0 || t.data_ptr()),
              "update_elementwise: `", name,
              "` is a tensor subclass with no memory of its own (a DTensor, for example); pass its local tensor "
              "(`.to_local()`) or a plain tensor");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "update_elementwise: `", name,
              "` must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "update_elementwise: `", name, "` must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.numel() == numel, "update_elementwise: `", name, "` has ", t.numel(), " elements, expected ", numel);
}

}  // namespace

void update_elementwise(int64_t algorithm, int64_t states, int64_t variant, int64_t rounding, at::Tensor param,
                        at::Tensor grad, at::Tensor state, at::Tensor state_scale, at::Tensor kahan_comp,
                        std::vector<double> hyper, double grad_scale, int64_t key_p, int64_t key_m,
                        int64_t index_offset) {
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "update_elementwise: rounding code ", rounding, " is not 0, 1 or 2");
  TORCH_CHECK(states == 0 || states == 1, "update_elementwise: takes at most one state, got ", states);
  TORCH_CHECK(hyper.size() == 9, "update_elementwise: needs 9 scalars, got ", hyper.size());
  TORCH_CHECK(index_offset >= 0, "update_elementwise: index_offset must be >= 0, got ", index_offset);
  const int64_t n = param.numel();
  const bool q8 = states == 1 && state.scalar_type() == at::kChar;
  const bool c8 = rounding == 2 && kahan_comp.scalar_type() == at::kChar;
  TORCH_CHECK(!q8 || index_offset % QBLOCK == 0, "update_elementwise: index_offset must be a multiple of ", QBLOCK,
              " with an 8-bit state, got ", index_offset);
  check_buffer("param", param, at::kBFloat16, n);
  check_buffer("grad", grad, at::kBFloat16, n);
  if (states == 1) check_buffer("state", state, q8 ? at::kChar : at::kBFloat16, n);
  if (q8) check_buffer("state_scale", state_scale, at::kBFloat16, (n + QBLOCK - 1) / QBLOCK);
  if (rounding == 2) check_buffer("kahan_comp", kahan_comp, c8 ? at::kChar : at::kBFloat16, n);
  Hyper s{};
  for (int i = 0; i < 9; ++i) s.h[i] = static_cast<float>(hyper[i]);
  s.grad_scale = static_cast<float>(grad_scale);
  s.variant = static_cast<int>(variant);
  uint16_t* P = reinterpret_cast<uint16_t*>(param.data_ptr());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(grad.data_ptr());
  void* S = states == 1 ? state.data_ptr() : nullptr;
  uint16_t* SS = q8 ? reinterpret_cast<uint16_t*>(state_scale.data_ptr()) : nullptr;
  void* C = rounding == 2 ? kahan_comp.data_ptr() : nullptr;
  if (algorithm == ALGORITHM_LION) {
    TORCH_CHECK(states == 1, "update_elementwise: Lion keeps one state, got ", states);
    if (q8) dispatch_rounding<Lion, 2>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset);
    else dispatch_rounding<Lion, 1>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset);
  } else if (algorithm == ALGORITHM_SGD) {
    if (states == 0) dispatch_rounding<Sgd<0>, 0>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset);
    else if (q8) dispatch_rounding<Sgd<1>, 2>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset);
    else dispatch_rounding<Sgd<1>, 1>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset);
  } else {
    TORCH_CHECK(false, "update_elementwise: algorithm ", algorithm, " has no generic loop");
  }
}
