// The generic loop of the update: any algorithm of algorithms.h with at most one state per element, its state bf16
// or 8-bit (int8 codes, a bf16 scale per block), the weight written with stochastic rounding, Kahan (bf16 or 8-bit
// remainder) or to nearest. Portable code the compiler vectorizes, block by block of QBLOCK elements, with the
// PyTorch path's bits.
#include "algorithms.h"
#include "q8.h"
#include "update_cpu.h"

namespace {

// FORMAT: 0 no state, 1 a bf16 state, 2 an 8-bit state; CT: the Kahan remainder's type (uint16_t bf16, int8_t). A run
// of `count` (<= QBLOCK) elements whose indices share their high word: lo0 is the first one's low word, kp and km the
// weight's and the state's block keys (the high word folded in). Separate simple loops, each of which the compiler
// vectorizes: decode, update (the stochastic sums decided from the float32 sum, as portable.h does, the rare
// elements near a carry flagged and decided again exactly), encode.
template <class A, int ROUNDING, int FORMAT, typename CT>
void update_run(uint16_t* __restrict__ P, const uint16_t* __restrict__ G, void* S, uint16_t* SS, CT* __restrict__ C,
                int64_t count, const Hyper& s, uint32_t lo0, uint32_t kp, uint32_t km) {
  alignas(64) float state[QBLOCK];  // 8-bit states, decoded, then their new values
  alignas(64) float abuf[QBLOCK];
  alignas(64) float dbuf[QBLOCK];
  uint16_t* __restrict__ Sb = FORMAT == 1 ? static_cast<uint16_t*>(S) : nullptr;
  int8_t* __restrict__ Sq = FORMAT == 2 ? static_cast<int8_t*>(S) : nullptr;
  if constexpr (FORMAT == 2) {
    const float scale = widen(*SS);
    for (int64_t j = 0; j < count; ++j) state[j] = decode_m(Sq[j], scale);
  }
  uint32_t exact = 0;
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t lo = lo0 + static_cast<uint32_t>(j);
    const uint32_t r = mix32(lo ^ kp);
    const float p = widen(P[j]);
    float g = widen(G[j]);
    if (s.grad_scale != 1.0f) g = g * s.grad_scale;
    float st = 0.0f;
    if constexpr (FORMAT == 1) st = widen(Sb[j]);
    if constexpr (FORMAT == 2) st = state[j];
    const float delta = A::step(p, g, st, s);
    if constexpr (FORMAT == 1) Sb[j] = ROUNDING == 0 ? round_nearest(st) : round_stochastic(st, mix32(lo ^ km));
    if constexpr (FORMAT == 2) state[j] = st;
    if constexpr (ROUNDING == 2) {
      float c;
      if constexpr (sizeof(CT) == 1) c = static_cast<float>(C[j]) * residual_unit(P[j]);
      else c = widen(C[j]);
      const uint16_t out = round_nearest(p + (delta + c));
      // The new remainder: the old one, less what the write took, plus the update (see the PyTorch path).
      const float a = c - (widen(out) - p);
      if constexpr (sizeof(CT) == 1) {
        C[j] = encode_residual(a + delta, out, r);
      } else {
        abuf[j] = a;
        dbuf[j] = delta;
        C[j] = round_stochastic_sum_fast(a, delta, r, exact);
      }
      P[j] = out;
    } else if constexpr (ROUNDING == 1) {
      abuf[j] = p;
      dbuf[j] = delta;
      P[j] = round_stochastic_sum_fast(p, delta, r, exact);
    } else {
      P[j] = round_nearest(p + delta);
    }
  }
  if (exact != 0) {  // rare: decided again from the exact sums
    for (int64_t j = 0; j < count; ++j) {
      const uint16_t out = round_stochastic_sum(abuf[j], dbuf[j], mix32((lo0 + static_cast<uint32_t>(j)) ^ kp));
      if constexpr (ROUNDING == 2) reinterpret_cast<uint16_t*>(C)[j] = out;
      else P[j] = out;
    }
  }
  if constexpr (FORMAT == 2) {
    // The block's scale from its largest magnitude (the largest pattern with the sign cleared), then the codes.
    uint32_t most = 0;
    for (int64_t j = 0; j < count; ++j) most = std::max(most, bits_of(state[j]) & 0x7FFFFFFFu);
    *SS = bf16_ceil(float_of(most));
    const float new_scale = widen(*SS);
    for (int64_t j = 0; j < count; ++j)
      Sq[j] = encode_m(state[j], new_scale, mix32((lo0 + static_cast<uint32_t>(j)) ^ km));
  }
}

template <class A, int ROUNDING, int FORMAT, typename CT>
void update_all(uint16_t* P, const uint16_t* G, void* S, uint16_t* SS, void* C, int64_t n, const Hyper& s,
                int64_t key_p, int64_t key_m, int64_t offset) {
  const int64_t blocks = (n + QBLOCK - 1) / QBLOCK;
  const int64_t state_size = FORMAT == 2 ? 1 : 2;
  at::parallel_for(0, blocks, 128, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t end = std::min((b + 1) * QBLOCK, n);
      // A block whose indices cross a multiple of 2**32 runs in two parts, one per high word (only with bf16 or no
      // states: 8-bit blocks start at multiples of QBLOCK, as 2**32 is one).
      for (int64_t begin = b * QBLOCK; begin < end;) {
        const int64_t global = begin + offset;
        const int64_t stop = std::min(end, (((global >> 32) + 1) << 32) - offset);
        const uint32_t hi = static_cast<uint32_t>(global >> 32);
        void* Sb = FORMAT == 0 ? nullptr : static_cast<char*>(S) + begin * state_size;
        CT* Cb = ROUNDING == 2 ? static_cast<CT*>(C) + begin : nullptr;
        update_run<A, ROUNDING, FORMAT, CT>(P + begin, G + begin, Sb, FORMAT == 2 ? SS + b : nullptr, Cb, stop - begin,
                                            s, static_cast<uint32_t>(global), mix32(static_cast<uint32_t>(key_p) ^ hi),
                                            mix32(static_cast<uint32_t>(key_m) ^ hi));
        begin = stop;
      }
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

// One call's buffers and scalars, handed to the loop an algorithm, variant and format select.
struct Run {
  int64_t rounding;
  bool c8;
  uint16_t* P;
  const uint16_t* G;
  void* S;
  uint16_t* SS;
  void* C;
  int64_t n;
  Hyper s;
  int64_t key_p, key_m, offset;

  template <class A, int FORMAT>
  void go() const {
    dispatch_rounding<A, FORMAT>(rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, offset);
  }
  template <int FORMAT>
  void sgd_with_momentum(int64_t variant) const {
    switch (variant & 3) {
      case 0:
        return go<Sgd<1, 0>, FORMAT>();
      case 1:
        return go<Sgd<1, 1>, FORMAT>();
      case 2:
        return go<Sgd<1, 2>, FORMAT>();
      default:
        return go<Sgd<1, 3>, FORMAT>();
    }
  }
};

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
  uint16_t* P = reinterpret_cast<uint16_t*>(param.data_ptr());
  const uint16_t* G = reinterpret_cast<const uint16_t*>(grad.data_ptr());
  void* S = states == 1 ? state.data_ptr() : nullptr;
  uint16_t* SS = q8 ? reinterpret_cast<uint16_t*>(state_scale.data_ptr()) : nullptr;
  void* C = rounding == 2 ? kahan_comp.data_ptr() : nullptr;
  const Run run{rounding, c8, P, G, S, SS, C, n, s, key_p, key_m, index_offset};
  // Every algorithm, variant and state format compiled on its own (the loop has no branch on them).
  if (algorithm == ALGORITHM_LION) {
    TORCH_CHECK(states == 1, "update_elementwise: Lion keeps one state, got ", states);
    if (q8) variant & 1 ? run.go<Lion<1>, 2>() : run.go<Lion<0>, 2>();
    else variant & 1 ? run.go<Lion<1>, 1>() : run.go<Lion<0>, 1>();
  } else if (algorithm == ALGORITHM_SGD) {
    TORCH_CHECK(states == 1 || (variant & 2) == 0, "update_elementwise: Nesterov momentum without a momentum state");
    if (states == 0) variant & 1 ? run.go<Sgd<0, 1>, 0>() : run.go<Sgd<0, 0>, 0>();
    else if (q8) run.sgd_with_momentum<2>(variant);
    else run.sgd_with_momentum<1>(variant);
  } else if (algorithm == ALGORITHM_DIRECTION) {
    TORCH_CHECK(states == 0, "update_elementwise: a direction's write keeps no state, got ", states);
    variant & 1 ? run.go<Direction<1>, 0>() : run.go<Direction<0>, 0>();
  } else {
    TORCH_CHECK(false, "update_elementwise: algorithm ", algorithm, " has no generic loop");
  }
}
