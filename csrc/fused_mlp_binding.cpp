// pybind11 binding of the fused MLP GEMMs (fused_mlp.cu). Every tensor check lives here (device,
// dtype, rank, shape, contiguity, the 16-byte alignment and the aux leading-dimension rule of the
// cuBLASLt epilogues), so that a bad call raises a RuntimeError that names the argument instead of
// a cuBLAS status. The GEMMs run on torch's cuBLASLt handle, stream and cuBLASLt workspace, so
// they order with torch's own matmuls like any other op on the current stream.
#include <ATen/cuda/CUDAContextLight.h>  // getCurrentCUDABlasLtHandle, getCUDABlasLtWorkspace(Size)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <tuple>

#include "launchers.h"

namespace {

using megapar::DType;

constexpr uint64_t kAlignBytes = 16;   // pointers of A, B, D, bias and aux
constexpr int64_t kAuxLdMultiple = 8;  // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD for the GELU aux matrix

// t is argument `name` of `op`; ref is the call's first tensor (device and dtype must match it).
void check_operand(const char* op, const torch::Tensor& t, const char* name, int64_t dim, const torch::Tensor& ref) {
  TORCH_CHECK(t.is_cuda(), "megapar_kernels.", op, ": ", name, " must be a CUDA tensor (got ", t.device(), ")");
  TORCH_CHECK(t.device() == ref.device(), "megapar_kernels.", op, ": ", name, " is on ", t.device(),
              " but the first input is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf, "megapar_kernels.", op, ": ",
              name, " must be bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "megapar_kernels.", op, ": ", name, " has dtype ", t.scalar_type(),
              " but the first input has ", ref.scalar_type(), " (all inputs must share one dtype)");
  TORCH_CHECK(t.dim() == dim, "megapar_kernels.", op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "megapar_kernels.", op, ": ", name, " must be contiguous (shape ", t.sizes(),
              ", strides ", t.strides(), "); call .contiguous() first");
  const uint64_t misalign = reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignBytes;
  TORCH_CHECK(misalign == 0, "megapar_kernels.", op, ": ", name, " must be 16-byte aligned for the cuBLASLt ",
              "epilogue, but its data starts ", misalign, " bytes past a 16-byte boundary (a view with a storage ",
              "offset? .clone() it)");
}

void check_aux_ld(const char* op, int64_t features, const char* what) {
  TORCH_CHECK(features % kAuxLdMultiple == 0, "megapar_kernels.", op, ": ", what, " = ", features,
              " must be a multiple of 8: `pre` [T, ", what, "] is cuBLASLt's GELU aux matrix, whose leading ",
              "dimension must be divisible by 8");
}

DType dtype_of(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
}

void ok(const char* op, const char* err) { TORCH_CHECK(err == nullptr, "megapar_kernels.", op, ": ", err ? err : ""); }

// x [T, in], weight [out, in], bias [out] -> (h, pre), both [T, out]: pre = x @ weight^T + bias,
// h = gelu_tanh(pre).
std::tuple<torch::Tensor, torch::Tensor> linear_gelu_fwd(const torch::Tensor& x, const torch::Tensor& weight,
                                                         const torch::Tensor& bias) {
  const char* op = "linear_gelu_forward";
  check_operand(op, x, "x [T, in]", 2, x);
  check_operand(op, weight, "weight [out, in]", 2, x);
  check_operand(op, bias, "bias [out]", 1, x);
  const int64_t tokens = x.size(0), in = x.size(1), out = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && bias.size(0) == out, "megapar_kernels.", op, ": shapes do not match: x ",
              x.sizes(), ", weight ", weight.sizes(), " (expected [out, ", in, "]), bias ", bias.sizes(),
              " (expected [", out, "])");
  TORCH_CHECK(in > 0 && out > 0, "megapar_kernels.", op, ": in and out features must be positive, got x ", x.sizes(),
              ", weight ", weight.sizes());
  check_aux_ld(op, out, "out");
  const c10::cuda::CUDAGuard guard(x.device());
  auto h = torch::empty({tokens, out}, x.options());
  auto pre = torch::empty({tokens, out}, x.options());
  ok(op, megapar::linear_gelu_forward(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), h.data_ptr(), pre.data_ptr(),
                                      tokens, in, out, dtype_of(x), at::cuda::getCurrentCUDABlasLtHandle(),
                                      at::cuda::getCUDABlasLtWorkspace(), at::cuda::getCUDABlasLtWorkspaceSize(),
                                      c10::cuda::getCurrentCUDAStream().stream()));
  return {h, pre};
}

// grad [T, o2], weight2 [o2, f], pre [T, f] -> (grad_pre [T, f] in the input dtype, bias_grad [f]
// fp32): grad_pre = gelu_tanh'(pre) * (grad @ weight2), bias_grad = grad_pre summed over T.
std::tuple<torch::Tensor, torch::Tensor> linear_dgelu_bwd(const torch::Tensor& grad, const torch::Tensor& weight2,
                                                          const torch::Tensor& pre) {
  const char* op = "linear_dgelu_backward";
  check_operand(op, grad, "grad [T, o2]", 2, grad);
  check_operand(op, weight2, "weight2 [o2, f]", 2, grad);
  check_operand(op, pre, "pre [T, f]", 2, grad);
  const int64_t tokens = grad.size(0), o2 = grad.size(1), f = weight2.size(1);
  TORCH_CHECK(weight2.size(0) == o2 && pre.size(0) == tokens && pre.size(1) == f, "megapar_kernels.", op,
              ": shapes do not match: grad ", grad.sizes(), ", weight2 ", weight2.sizes(), " (expected [", o2,
              ", f]), pre ", pre.sizes(), " (expected [", tokens, ", ", f, "])");
  TORCH_CHECK(o2 > 0 && f > 0, "megapar_kernels.", op, ": feature counts must be positive, got grad ", grad.sizes(),
              ", weight2 ", weight2.sizes());
  check_aux_ld(op, f, "f");
  const c10::cuda::CUDAGuard guard(grad.device());
  auto grad_pre = torch::empty({tokens, f}, grad.options());
  // cuBLASLt writes the DGELU_BGRAD bias gradient in the GEMM's output type (cublasLt.h: fp32 is
  // not a documented bias type for fp16/bf16 outputs), so it lands in the input dtype here and is
  // converted to fp32 below (one small extra kernel; the sum itself is accumulated by cuBLASLt).
  auto bias_grad = torch::empty({f}, grad.options());
  ok(op, megapar::linear_dgelu_backward(grad.data_ptr(), weight2.data_ptr(), pre.data_ptr(), grad_pre.data_ptr(),
                                        bias_grad.data_ptr(), tokens, f, o2, dtype_of(grad),
                                        at::cuda::getCurrentCUDABlasLtHandle(), at::cuda::getCUDABlasLtWorkspace(),
                                        at::cuda::getCUDABlasLtWorkspaceSize(),
                                        c10::cuda::getCurrentCUDAStream().stream()));
  return {grad_pre, bias_grad.to(torch::kFloat32)};
}

}  // namespace

void register_fused_mlp(pybind11::module_& m) {
  m.def("linear_gelu_forward", &linear_gelu_fwd,
        "(h, pre) with pre = x @ weight^T + bias and h = gelu_tanh(pre): one cuBLASLt GEMM (GELU_AUX_BIAS epilogue)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"));
  m.def("linear_dgelu_backward", &linear_dgelu_bwd,
        "(grad_pre, bias_grad fp32) with grad_pre = gelu_tanh'(pre) * (grad @ weight2): one cuBLASLt GEMM "
        "(DGELU_BGRAD epilogue)",
        pybind11::arg("grad"), pybind11::arg("weight2"), pybind11::arg("pre"));
}
