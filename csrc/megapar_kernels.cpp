// pybind11 binding for megapar's CUDA kernels: every tensor check lives here (device, dtype,
// contiguity, shape limits) so that a bad call raises a clear Python error instead of
// reaching a kernel. The launchers (softmax.cu, layernorm.cu) take raw pointers only.
//
// Versions tried / why this one: the first binding included torch in the .cu files, which
// made each nvcc compile slow and tied the kernels to torch headers; now only this file
// sees torch, and the kernels build (and are syntax-checked in CI) with nvcc alone.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>

#include "launchers.h"

void register_adamw(pybind11::module_& m);  // adamw_binding.cpp

namespace {

using megapar::DType;

DType dtype_of(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return DType::kFloat32;
    case torch::kFloat16: return DType::kFloat16;
    case torch::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "megapar_kernels: ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "megapar_kernels: ", name, " must be a CUDA tensor (got ", t.device(), ")");
  TORCH_CHECK(t.is_contiguous(), "megapar_kernels: ", name, " must be contiguous");
}

void check_like(const torch::Tensor& t, const torch::Tensor& ref, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.device() == ref.device(), "megapar_kernels: ", name, " is on ", t.device(), ", expected ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "megapar_kernels: ", name, " has dtype ", t.scalar_type(),
              ", expected ", ref.scalar_type());
}

void ok(const char* err) { TORCH_CHECK(err == nullptr, "megapar_kernels: ", err ? err : ""); }

bool vectorizable(int64_t cols, DType dt) { return cols % (dt == DType::kFloat32 ? 4 : 8) == 0; }

void check_cols(int64_t cols, DType dt, int64_t max_cols, const char* what) {
  TORCH_CHECK(cols > 0 && cols <= max_cols, "megapar_kernels: ", what, " = ", cols, " is outside the supported range 1..",
              max_cols, " for this dtype", vectorizable(cols, dt) ? "" : " (and this length is not a multiple of 16 bytes)");
}

// scores [b, np, sq, sk] -> probs; mask: optional bool [b or 1, 1, sq, sk] (True = masked out).
torch::Tensor softmax_fwd(const torch::Tensor& x, double scale, const std::optional<torch::Tensor>& mask, bool causal) {
  check_cuda(x, "scores");
  const DType dt = dtype_of(x, "scores");
  TORCH_CHECK(x.dim() == 4, "megapar_kernels: scores must be 4-D [b, np, sq, sk], got ", x.sizes());
  const int64_t b = x.size(0), np = x.size(1), sq = x.size(2), sk = x.size(3);
  check_cols(sk, dt, megapar::softmax_max_cols(dt, vectorizable(sk, dt)), "sk");
  TORCH_CHECK(!causal || sq == sk, "megapar_kernels: the causal softmax needs sq == sk, got sq=", sq, " sk=", sk);
  const uint8_t* mptr = nullptr;
  int mask_batches = 1;
  if (mask.has_value()) {
    const auto& m = *mask;
    check_cuda(m, "mask");
    TORCH_CHECK(m.scalar_type() == torch::kBool, "megapar_kernels: mask must be bool, got ", m.scalar_type());
    TORCH_CHECK(m.device() == x.device(), "megapar_kernels: mask is on ", m.device(), ", scores on ", x.device());
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == b) && m.size(1) == 1 && m.size(2) == sq &&
                    m.size(3) == sk,
                "megapar_kernels: mask must be [1 or b, 1, sq, sk] = [1 or ", b, ", 1, ", sq, ", ", sk, "], got ",
                m.sizes());
    mptr = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    mask_batches = static_cast<int>(m.size(0));
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  ok(megapar::softmax_forward(x.data_ptr(), y.data_ptr(), mptr, b * np * sq, static_cast<int>(sq),
                              static_cast<int>(sk), np * sq, mask_batches, static_cast<float>(scale), causal, dt,
                              c10::cuda::getCurrentCUDAStream().stream()));
  return y;
}

torch::Tensor softmax_bwd(const torch::Tensor& dy, const torch::Tensor& y, double scale, bool causal) {
  check_cuda(y, "probs");
  const DType dt = dtype_of(y, "probs");
  check_like(dy, y, "grad");
  TORCH_CHECK(y.dim() == 4 && dy.sizes() == y.sizes(), "megapar_kernels: grad ", dy.sizes(), " and probs ", y.sizes(),
              " must be equal 4-D shapes");
  const int64_t sq = y.size(2), sk = y.size(3);
  check_cols(sk, dt, megapar::softmax_max_cols(dt, vectorizable(sk, dt)), "sk");
  TORCH_CHECK(!causal || sq == sk, "megapar_kernels: the causal softmax needs sq == sk");
  const c10::cuda::CUDAGuard guard(y.device());
  auto dx = torch::empty_like(y);
  ok(megapar::softmax_backward(y.data_ptr(), dy.data_ptr(), dx.data_ptr(), y.numel() / sk, static_cast<int>(sq),
                               static_cast<int>(sk), static_cast<float>(scale), causal, dt,
                               c10::cuda::getCurrentCUDAStream().stream()));
  return dx;
}

void check_ln(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, DType dt) {
  check_like(w, x, "weight");
  check_like(b, x, "bias");
  const int64_t h = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h && b.dim() == 1 && b.size(0) == h, "megapar_kernels: weight ", w.sizes(),
              " and bias ", b.sizes(), " must be [", h, "]");
  check_cols(h, dt, megapar::layernorm_max_cols(dt, vectorizable(h, dt)), "hidden size");
}

// x [..., h] -> (y, mean [rows], rstd [rows]) or, with a residual, (y, x + residual, mean, rstd).
std::vector<torch::Tensor> ln_fwd(const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
                                  const torch::Tensor& w, const torch::Tensor& b, double eps) {
  check_cuda(x, "input");
  const DType dt = dtype_of(x, "input");
  TORCH_CHECK(x.dim() >= 1, "megapar_kernels: input must have at least one dimension");
  check_ln(x, w, b, dt);
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x);
  auto opts = x.options().dtype(torch::kFloat32);
  auto mean = torch::empty({rows}, opts), rstd = torch::empty({rows}, opts);
  torch::Tensor sum;
  if (residual.has_value()) {
    check_like(*residual, x, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "megapar_kernels: residual ", residual->sizes(), " must match input ",
                x.sizes());
    sum = torch::empty_like(x);
  }
  ok(megapar::layernorm_forward(x.data_ptr(), residual ? residual->data_ptr() : nullptr, w.data_ptr(), b.data_ptr(),
                                y.data_ptr(), residual ? sum.data_ptr() : nullptr, mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, static_cast<int>(h), static_cast<float>(eps), dt,
                                c10::cuda::getCurrentCUDAStream().stream()));
  if (residual.has_value()) return {y, sum, mean, rstd};
  return {y, mean, rstd};
}

// -> (dx, dw, db); dres (optional) is added to dx (gradient of the fused residual sum's other use).
std::vector<torch::Tensor> ln_bwd(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& mean,
                                  const torch::Tensor& rstd, const torch::Tensor& w,
                                  const std::optional<torch::Tensor>& dres) {
  check_cuda(x, "input");
  const DType dt = dtype_of(x, "input");
  check_like(dy, x, "grad");
  TORCH_CHECK(dy.sizes() == x.sizes(), "megapar_kernels: grad ", dy.sizes(), " must match input ", x.sizes());
  check_ln(x, w, w, dt);
  const int64_t h = x.size(-1), rows = x.numel() / h;
  for (const auto* t : {&mean, &rstd}) {
    check_cuda(*t, "mean/rstd");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->numel() == rows, "megapar_kernels: mean/rstd must be float32 [",
                rows, "]");
  }
  if (dres.has_value()) {
    check_like(*dres, x, "residual grad");
    TORCH_CHECK(dres->sizes() == x.sizes(), "megapar_kernels: residual grad must match input");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = torch::empty_like(x);
  if (rows == 0) return {dx, torch::zeros_like(w), torch::zeros_like(w)};
  auto dw = torch::empty_like(w), db = torch::empty_like(w);
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()) == cudaSuccess,
              "megapar_kernels: cannot read the multiprocessor count");
  const int64_t groups = megapar::layernorm_backward_groups(rows, static_cast<int>(h), dt, sms);
  auto ws = torch::empty({groups, 2, h}, x.options().dtype(torch::kFloat32));
  ok(megapar::layernorm_backward(dy.data_ptr(), x.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                 w.data_ptr(), dres ? dres->data_ptr() : nullptr, dx.data_ptr(), ws.data_ptr<float>(),
                                 groups, dw.data_ptr(), db.data_ptr(), rows, static_cast<int>(h), dt,
                                 c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, dw, db};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megapar fused CUDA kernels: scaled causal/masked softmax and LayerNorm (fp32 math)";
  m.def("scaled_masked_softmax_forward", &softmax_fwd, "probs = softmax(scale * scores) with a causal or bool mask",
        py::arg("scores"), py::arg("scale"), py::arg("mask") = py::none(), py::arg("causal") = false);
  m.def("scaled_masked_softmax_backward", &softmax_bwd, "grad of scaled_masked_softmax_forward w.r.t. scores",
        py::arg("grad"), py::arg("probs"), py::arg("scale"), py::arg("causal") = false);
  m.def("layer_norm_forward", &ln_fwd, "LayerNorm forward (optionally residual add first)", py::arg("input"),
        py::arg("residual") = py::none(), py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_backward", &ln_bwd, "LayerNorm backward -> (dx, dweight, dbias)", py::arg("grad"),
        py::arg("input"), py::arg("mean"), py::arg("rstd"), py::arg("weight"), py::arg("residual_grad") = py::none());
  register_adamw(m);
}
