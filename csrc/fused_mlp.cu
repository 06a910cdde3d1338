// Launchers for the GPT-2 MLP's two GELU-fused GEMMs: one cublasLtMatmul each, with the tanh
// GELU (forward) or its derivative and the first bias's gradient (backward) in the epilogue.
//
// Versions tried / why this one: this is the first version, not yet run on a GPU here. Unfused,
// the MLP pays one extra read + write of the [T, 4h] activation for bias + GELU forward and one
// for the GELU gradient backward, plus a column sum for the bias gradient; cuBLASLt's
// GELU_AUX_BIAS / DGELU_BGRAD epilogues fold all three into GEMMs that run anyway. Considered
// instead: a hand-written GEMM with our own epilogue (it would first have to match cuBLAS at
// these shapes, ~750 TFLOP/s per the README, before the saved passes count), and a Triton matmul
// with a GELU epilogue (a second compiler and autotuning in the build; its speed against cuBLAS
// at these shapes was not measured). Known risk, to be measured before this becomes a default: a
// public report (karpathy/llm.c PR 338, 2024) found cuBLASLt's bf16 GELU epilogue kernels slower
// than a plain GEMM plus a separate GELU kernel. Nothing is cached here: the descriptors are
// built per call (host time only, which CUDA graphs remove) and the algorithm comes from
// cuBLASLt's heuristic, which keeps its own cache.
//
// Row-major torch vs column-major cuBLASLt: a row-major [r, c] matrix is a column-major [c, r]
// one with leading dimension c. Forward Y[T, out] = X[T, in] W[out, in]^T is, column-major,
// D[out, T] = op(A) B with A = W (stored [in, out], transa = T, lda = in), B = X (stored [in, T],
// ldb = in), m = out, n = T, k = in, ldd = out; the bias is per row m (output feature). Backward
// G_h[T, f] = G[T, o2] W2[o2, f] is D[f, T] = A B with A = W2 (stored [f, o2], transa = N,
// lda = f), B = G (stored [o2, T], ldb = o2), m = f, n = T, k = o2; the aux matrix `pre` has the
// layout of D (ld = m) and BGRAD sums each of D's m rows over n = T.
#include <cublasLt.h>

#include <cstdio>

#include "common.cuh"

namespace megapar {
namespace {

// Owns one call's descriptors: every return path, errors included, destroys what was created.
struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C uses D's layout (beta = 0)
  cublasLtMatmulPreference_t pref = nullptr;

  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

// One column-major GEMM with an epilogue: D[m, n] = op(A)[m, k] B[k, n], B never transposed,
// D contiguous (ldd = m). bias: bias (forward) or bias gradient (backward), m elements of the
// GEMM's dtype. aux: the GELU input, [m, n] with leading dimension m (written forward, read backward).
struct EpilogueGemm {
  const char* name;
  cublasLtEpilogue_t epilogue;
  const char* epilogue_name;
  cublasOperation_t transa;
  int64_t m, n, k, lda, ldb;
  const void* a;
  const void* b;
  void* d;
  void* bias;
  void* aux;
};

constexpr int64_t kAuxLdMultiple = 8;  // cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD (GELU aux)
constexpr int kPtrAlign = 16;          // what the binding guarantees for every pointer

thread_local char g_message[640];

const char* describe(const EpilogueGemm& g, DType dt, const char* what, cublasStatus_t status, size_t ws_bytes) {
  std::snprintf(g_message, sizeof(g_message),
                "%s: %s: %s (%s) [cuBLASLt %zu, epilogue %s, %s, column-major m=%lld n=%lld k=%lld, "
                "workspace %zu bytes]",
                g.name, what, cublasLtGetStatusName(status), cublasLtGetStatusString(status), cublasLtGetVersion(),
                g.epilogue_name, dt == DType::kBFloat16 ? "bf16" : "fp16", static_cast<long long>(g.m),
                static_cast<long long>(g.n), static_cast<long long>(g.k), ws_bytes);
  return g_message;
}

// Largest power of two (up to 256, cuBLASLt's default assumption) that divides the address.
uint32_t alignment_of(const void* p) {
  uint32_t align = 256;
  while (align > 1 && !aligned(p, static_cast<int>(align))) align /= 2;
  return align;
}

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value));
}

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
}

// Returns the described status from run() when a cuBLASLt call fails (lt's destructor cleans up).
#define MEGAPAR_LT_TRY(what, expr)                                                          \
  do {                                                                                      \
    const cublasStatus_t status_ = (expr);                                                  \
    if (status_ != CUBLAS_STATUS_SUCCESS) return describe(g, dt, what, status_, ws_bytes); \
  } while (0)

const char* run(const EpilogueGemm& g, DType dt, cublasLtHandle_t handle, void* workspace, size_t ws_bytes,
                cudaStream_t stream) {
  if (dt == DType::kFloat32) return "fused MLP GEMM: float16 or bfloat16 only (the epilogues are not used for fp32)";
  if (handle == nullptr) return "fused MLP GEMM: no cuBLASLt handle";
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) return "fused MLP GEMM: every GEMM dimension must be positive";
  if (g.m % kAuxLdMultiple != 0)
    return "fused MLP GEMM: the GELU aux matrix's leading dimension (the feature count) must be a multiple of 8";
  for (const void* p : {g.a, g.b, static_cast<const void*>(g.d), static_cast<const void*>(g.bias),
                        static_cast<const void*>(g.aux)}) {
    if (p == nullptr || !aligned(p, kPtrAlign)) return "fused MLP GEMM: every pointer must be set and 16-byte aligned";
  }
  if (workspace == nullptr) ws_bytes = 0;

  const cudaDataType_t type = dt == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  LtDescriptors lt;
  // fp32 accumulation and fp32 alpha/beta (scale type) for fp16/bf16 A, B, D.
  MEGAPAR_LT_TRY("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&lt.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transb = CUBLAS_OP_N;
  MEGAPAR_LT_TRY("set TRANSA", set_attr(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, g.transa));
  MEGAPAR_LT_TRY("set TRANSB", set_attr(lt.op, CUBLASLT_MATMUL_DESC_TRANSB, transb));
  MEGAPAR_LT_TRY("set EPILOGUE", set_attr(lt.op, CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue));
  // Bias / bias gradient: cublasLt.h documents its type as D's type for fp16/bf16 GEMMs (the only
  // exceptions are IMMA and fp8 kernels), for the bias of GELU_AUX_BIAS and the bias gradient of
  // DGELU_BGRAD alike, so CUDA_R_32F is not used; the binding converts the bias gradient to fp32.
  // Set explicitly (the default, -1, means the same) so the choice is visible here.
  const int32_t bias_type = type;
  MEGAPAR_LT_TRY("set BIAS_POINTER", set_attr(lt.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias));
  MEGAPAR_LT_TRY("set BIAS_DATA_TYPE", set_attr(lt.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type));
  // GELU input (aux): D's type by default (EPILOGUE_AUX_DATA_TYPE left unset; setting it is for
  // fp8), leading dimension m (a multiple of 8, no less than D's rows), no batch stride.
  const int64_t aux_ld = g.m;
  MEGAPAR_LT_TRY("set EPILOGUE_AUX_POINTER", set_attr(lt.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux));
  MEGAPAR_LT_TRY("set EPILOGUE_AUX_LD", set_attr(lt.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld));

  // Layouts describe the stored matrices: A is [k, m] when transposed, [m, k] otherwise.
  const bool ta = g.transa == CUBLAS_OP_T;
  MEGAPAR_LT_TRY("cublasLtMatrixLayoutCreate(A)",
                 cublasLtMatrixLayoutCreate(&lt.a, type, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  MEGAPAR_LT_TRY("cublasLtMatrixLayoutCreate(B)", cublasLtMatrixLayoutCreate(&lt.b, type, g.k, g.n, g.ldb));
  MEGAPAR_LT_TRY("cublasLtMatrixLayoutCreate(D)", cublasLtMatrixLayoutCreate(&lt.d, type, g.m, g.n, g.m));

  MEGAPAR_LT_TRY("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&lt.pref));
  const uint64_t max_ws = ws_bytes;
  MEGAPAR_LT_TRY("set MAX_WORKSPACE_BYTES", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws));
  // Split-K partial sums in fp32 only (no in-place or output-type reduction in fp16/bf16).
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  MEGAPAR_LT_TRY("set REDUCTION_SCHEME_MASK", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction));
  // The heuristic assumes 256-byte aligned A/B/C/D unless told otherwise (bias and aux alignment
  // it reads from the pointers set above).
  const uint32_t align_a = alignment_of(g.a), align_b = alignment_of(g.b), align_d = alignment_of(g.d);
  MEGAPAR_LT_TRY("set MIN_ALIGNMENT_A", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a));
  MEGAPAR_LT_TRY("set MIN_ALIGNMENT_B", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b));
  MEGAPAR_LT_TRY("set MIN_ALIGNMENT_C", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d));
  MEGAPAR_LT_TRY("set MIN_ALIGNMENT_D", set_attr(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d));

  cublasLtMatmulHeuristicResult_t best = {};
  int found = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(handle, lt.op, lt.a, lt.b, lt.d, lt.d, lt.pref, 1, &best, &found);
  if (hs == CUBLAS_STATUS_SUCCESS && (found == 0 || best.state != CUBLAS_STATUS_SUCCESS))
    return describe(g, dt, "cublasLtMatmulAlgoGetHeuristic found no algorithm", CUBLAS_STATUS_NOT_SUPPORTED,
                    ws_bytes);
  MEGAPAR_LT_TRY("cublasLtMatmulAlgoGetHeuristic", hs);

  const float alpha = 1.0f, beta = 0.0f;
  MEGAPAR_LT_TRY("cublasLtMatmul", cublasLtMatmul(handle, lt.op, &alpha, g.a, lt.a, g.b, lt.b, &beta, g.d, lt.d, g.d,
                                                  lt.d, &best.algo, ws_bytes > 0 ? workspace : nullptr, ws_bytes,
                                                  stream));
  return nullptr;
}

#undef MEGAPAR_LT_TRY

}  // namespace

const char* linear_gelu_forward(const void* x, const void* w, const void* b, void* h, void* pre, int64_t tokens,
                                int64_t in, int64_t out, DType dt, cublasLtHandle_t handle, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  if (tokens == 0) return nullptr;
  EpilogueGemm g{};
  g.name = "linear_gelu_forward";
  g.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;  // D = gelu(AB + bias), aux = AB + bias
  g.epilogue_name = "GELU_AUX_BIAS";
  g.transa = CUBLAS_OP_T;
  g.m = out, g.n = tokens, g.k = in, g.lda = in, g.ldb = in;
  g.a = w, g.b = x, g.d = h;
  g.bias = const_cast<void*>(b);  // read only: the attribute is shared with the bias gradient
  g.aux = pre;
  return run(g, dt, handle, workspace, workspace_bytes, stream);
}

const char* linear_dgelu_backward(const void* grad, const void* w2, const void* pre, void* grad_pre, void* bias_grad,
                                  int64_t tokens, int64_t f, int64_t o2, DType dt, cublasLtHandle_t handle,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (tokens == 0) {  // no GEMM; the bias gradient of an empty batch is zero
    const cudaError_t e = cudaMemsetAsync(bias_grad, 0, static_cast<size_t>(f) * 2, stream);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
  EpilogueGemm g{};
  g.name = "linear_dgelu_backward";
  g.epilogue = CUBLASLT_EPILOGUE_DGELU_BGRAD;  // D = gelu'(aux) * AB, bias = D summed over n
  g.epilogue_name = "DGELU_BGRAD";
  g.transa = CUBLAS_OP_N;
  g.m = f, g.n = tokens, g.k = o2, g.lda = f, g.ldb = o2;
  g.a = w2, g.b = grad, g.d = grad_pre;
  g.bias = bias_grad;
  g.aux = const_cast<void*>(pre);  // read only for DGELU
  return run(g, dt, handle, workspace, workspace_bytes, stream);
}

}  // namespace megapar
