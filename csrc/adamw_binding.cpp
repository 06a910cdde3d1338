// pybind11 binding of the multi-tensor AdamW launcher (adamw.cu). It checks the tables' shapes,
// dtypes and device; the pointers inside the tensor table are checked when the table is built
// (megapar/kernels/adamw.py: every tensor CUDA, contiguous, fp32 where it must be, same numel).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>

#include "launchers.h"

namespace {

void check_table(const torch::Tensor& t, const torch::Tensor& ref, torch::ScalarType dtype, int64_t cols,
                 const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), "megapar_kernels.adamw_step: ", name, " must be on ",
              ref.device(), " (got ", t.device(), ")");
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, "megapar_kernels.adamw_step: ", name,
              " must be a contiguous ", dtype, " tensor (got ", t.scalar_type(), ")");
  TORCH_CHECK(cols < 0 ? t.numel() == 1 : (t.dim() == 2 && t.size(1) == cols), "megapar_kernels.adamw_step: ", name,
              " has shape ", t.sizes(), ", expected ", cols < 0 ? "one element" : "[*, " + std::to_string(cols) + "]");
}

// param_dtype: the model parameters' dtype name, "bfloat16" or "float16" ("float32" when there is
// no low-precision copy).
void adamw_step(const torch::Tensor& tensors, const torch::Tensor& chunks, const torch::Tensor& hyper,
                const torch::Tensor& step, const std::optional<torch::Tensor>& grad_scale,
                const std::optional<torch::Tensor>& found_inf, double beta1, double beta2,
                double eps, const std::string& param_dtype) {
  check_table(tensors, tensors, torch::kInt64, megapar::adamw_table_cols(), "tensor table");
  check_table(chunks, tensors, torch::kInt64, 2, "chunk table");
  check_table(hyper, tensors, torch::kFloat32, 2, "hyper-parameter table");
  check_table(step, tensors, torch::kFloat32, -1, "step");
  if (grad_scale.has_value()) check_table(*grad_scale, tensors, torch::kFloat32, -1, "grad_scale");
  if (found_inf.has_value()) check_table(*found_inf, tensors, torch::kFloat32, -1, "found_inf");
  megapar::DType dt = megapar::DType::kFloat32;
  if (param_dtype == "bfloat16") {
    dt = megapar::DType::kBFloat16;
  } else if (param_dtype == "float16") {
    dt = megapar::DType::kFloat16;
  } else {
    TORCH_CHECK(param_dtype == "float32", "megapar_kernels.adamw_step: parameters must be float32, float16 or bfloat16, ",
                "got ", param_dtype);
  }
  const c10::cuda::CUDAGuard guard(tensors.device());
  const char* err = megapar::adamw_step(
      tensors.data_ptr<int64_t>(), chunks.data_ptr<int64_t>(), chunks.size(0), hyper.data_ptr<float>(),
      step.data_ptr<float>(), grad_scale ? grad_scale->data_ptr<float>() : nullptr,
      found_inf ? found_inf->data_ptr<float>() : nullptr, static_cast<float>(beta1),
      static_cast<float>(beta2), static_cast<float>(eps), dt, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "megapar_kernels.adamw_step: ", err ? err : "");
}

}  // namespace

void register_adamw(pybind11::module_& m) {
  m.def("adamw_step", &adamw_step,
        "AdamW on fp32 masters over a tensor table in one launch, writing the model's low-precision copy",
        py::arg("tensors"), py::arg("chunks"), py::arg("hyper"), py::arg("step"), py::arg("grad_scale"),
        py::arg("found_inf"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("param_dtype"));
  m.attr("adamw_chunk_elems") = megapar::adamw_chunk_elems();
  m.attr("adamw_table_cols") = megapar::adamw_table_cols();
}
