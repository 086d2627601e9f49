// The fused CPU loops of the pure-bf16 update: what Python calls (ops/update_cpu.py documents each).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

// One Adam/AdamW step in place over bf16 p, g, m, v (and the Kahan buffer); rounding 0 nearest, 1 stochastic, 2 Kahan.
void adamw_update_bf16(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                       at::Tensor kahan_comp, int64_t rounding, bool decoupled, double beta1, double one_minus_beta1,
                       double beta2, double one_minus_beta2, double eps, double weight_decay, double decay,
                       double neg_step_size, double inv_bias_correction2_sqrt, double grad_scale, int64_t key_p,
                       int64_t key_m, int64_t key_v, int64_t index_offset);

// The same step with 8-bit moments and/or an 8-bit Kahan remainder (ops/quant.py specifies the codes).
void adamw_update_q8(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                     at::Tensor exp_avg_scale, at::Tensor exp_avg_sq_scale, at::Tensor kahan_comp, int64_t rounding,
                     bool decoupled, double beta1, double one_minus_beta1, double beta2, double one_minus_beta2,
                     double eps, double weight_decay, double decay, double neg_step_size,
                     double inv_bias_correction2_sqrt, double grad_scale, int64_t key_p, int64_t key_m, int64_t key_v,
                     int64_t index_offset);

// One step of an algorithm of the generic loop (algorithms.h: Lion, SGD) over bf16 p and g, at most one state (bf16
// or int8 codes with their bf16 block scales) and the Kahan remainder; placeholders stand for absent buffers.
void update_elementwise(int64_t algorithm, int64_t states, int64_t variant, int64_t rounding, at::Tensor param,
                        at::Tensor grad, at::Tensor state, at::Tensor state_scale, at::Tensor kahan_comp,
                        std::vector<double> hyper, double grad_scale, int64_t key_p, int64_t key_m,
                        int64_t index_offset);

// Whether a contiguous bf16 CPU tensor holds an inf or NaN.
bool any_nonfinite_bf16(at::Tensor t);

// For the tests: the loops' stochastic rounding of exact sums, their 8-bit levels, and the vector loops' switch.
at::Tensor stochastic_round_sum_bf16(at::Tensor a, at::Tensor b, at::Tensor bits);
at::Tensor levels_8bit();
bool use_vector_loops(bool on);
