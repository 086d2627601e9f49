// The Python module of the fused CPU loop (built by ops/update_cpu.py with torch.utils.cpp_extension.load). The
// sources include ATen and torch's pybind casters, not torch/extension.h (all of torch's C++ API: twice the build
// time).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "update_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_update_bf16", torch::wrap_pybind_function(adamw_update_bf16), "adamw_update_bf16");
  m.def("adamw_update_q8", torch::wrap_pybind_function(adamw_update_q8), "adamw_update_q8");
  m.def("any_nonfinite_bf16", torch::wrap_pybind_function(any_nonfinite_bf16), "any_nonfinite_bf16");
  m.def("update_elementwise", torch::wrap_pybind_function(update_elementwise), "update_elementwise");
  m.def("levels_8bit", torch::wrap_pybind_function(levels_8bit), "levels_8bit");
  m.def("stochastic_round_sum_bf16", torch::wrap_pybind_function(stochastic_round_sum_bf16),
        "stochastic_round_sum_bf16");
  m.def("use_vector_loops", torch::wrap_pybind_function(use_vector_loops), "use_vector_loops");
}
