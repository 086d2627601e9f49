// The entry points of the fused CPU loop (declared in update_cpu.h, bound to Python in bindings.cpp).
#include "update_cpu.h"

#include "q8.h"

// The loops read and write raw memory: a tensor must hold its own. A Python wrapper subclass (a DTensor of FSDP2 or
// tensor parallelism, for one) has none (its data pointer is null), and would be written through as if it had.
static void check_has_memory(const char* function, const char* name, const at::Tensor& t) {
  TORCH_CHECK(
      !t.key_set().has(c10::DispatchKey::Python) && t.has_storage() && (t.numel() == 0 || t.data_ptr() != nullptr),
      function, ": `", name,
      "` is a tensor subclass with no memory of its own (a DTensor, for example); pass its local tensor "
      "(`.to_local()`) or a plain tensor");
}

void adamw_update_q8(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                     at::Tensor exp_avg_scale, at::Tensor exp_avg_sq_scale, at::Tensor kahan_comp, int64_t rounding,
                     bool decoupled, double beta1, double one_minus_beta1, double beta2, double one_minus_beta2,
                     double eps, double weight_decay, double decay, double neg_step_size,
                     double inv_bias_correction2_sqrt, double grad_scale, int64_t key_p, int64_t key_m, int64_t key_v,
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
  const std::pair<const char*, const at::Tensor*> buffers[] = {{"param", &param},
                                                               {"grad", &grad},
                                                               {"exp_avg", &exp_avg},
                                                               {"exp_avg_sq", &exp_avg_sq},
                                                               {"exp_avg_scale", &exp_avg_scale},
                                                               {"exp_avg_sq_scale", &exp_avg_sq_scale},
                                                               {"kahan_comp", &kahan_comp}};
  for (const auto& [name, t] : buffers) {
    const std::string key(name);
    if (rounding != 2 && key == "kahan_comp") continue;
    const bool scale = key == "exp_avg_scale" || key == "exp_avg_sq_scale";
    if (scale && !q8m) continue;
    check_has_memory("adamw_update_q8", name, *t);
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
  const Scalars s = scalars_of(beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, neg_step_size,
                               inv_bias_correction2_sqrt, grad_scale);
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
at::Tensor stochastic_round_sum_bf16(at::Tensor a, at::Tensor b, at::Tensor bits) {
  const int64_t n = a.numel();
  for (const at::Tensor* t : {&a, &b, &bits}) check_has_memory("stochastic_round_sum_bf16", "a, b, bits", *t);
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && bits.scalar_type() == at::kInt,
              "stochastic_round_sum_bf16: needs float32 a and b and int32 bits");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && bits.device().is_cpu() && a.is_contiguous() &&
                  b.is_contiguous() && bits.is_contiguous() && b.numel() == n && bits.numel() == n,
              "stochastic_round_sum_bf16: needs contiguous CPU tensors of one size");
  at::Tensor out = at::empty({n}, a.options().dtype(at::kBFloat16));
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
at::Tensor levels_8bit() {
  at::Tensor out = at::empty({128 + 256}, at::kFloat);
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
bool any_nonfinite_bf16(at::Tensor t) {
  check_has_memory("any_nonfinite_bf16", "t", t);
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

void adamw_update_bf16(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                       at::Tensor kahan_comp, int64_t rounding, bool decoupled, double beta1, double one_minus_beta1,
                       double beta2, double one_minus_beta2, double eps, double weight_decay, double decay,
                       double neg_step_size, double inv_bias_correction2_sqrt, double grad_scale, int64_t key_p,
                       int64_t key_m, int64_t key_v, int64_t index_offset) {
  // The loop reads raw bf16 words: every buffer must be a contiguous bf16 CPU tensor of the parameter's size.
  TORCH_CHECK(rounding >= 0 && rounding <= 2, "adamw_update_bf16: rounding code ", rounding, " is not 0, 1 or 2");
  TORCH_CHECK(index_offset >= 0, "adamw_update_bf16: index_offset must be >= 0, got ", index_offset);
  const int64_t numel = param.numel();
  const std::pair<const char*, const at::Tensor*> buffers[] = {{"param", &param},
                                                               {"grad", &grad},
                                                               {"exp_avg", &exp_avg},
                                                               {"exp_avg_sq", &exp_avg_sq},
                                                               {"kahan_comp", &kahan_comp}};
  for (const auto& [name, t] : buffers) {
    if (rounding != 2 && std::string(name) == "kahan_comp") continue;
    check_has_memory("adamw_update_bf16", name, *t);
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
  const Scalars s = scalars_of(beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay, neg_step_size,
                               inv_bias_correction2_sqrt, grad_scale);
  const bool l2 = !decoupled && weight_decay != 0.0, dec = decoupled && decay != 0.0;
  const int64_t n = param.numel();
  if (rounding == 0) dispatch_decay<0>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
  else if (rounding == 1) dispatch_decay<1>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
  else dispatch_decay<2>(l2, dec, P, G, M, V, C, n, s, key_p, key_m, key_v, index_offset);
}
