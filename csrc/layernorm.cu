// Launchers for the LayerNorm kernels (layernorm_kernels.cuh).
//
// Versions tried / why this one: forward uses the shared row-group shape list (common.cuh).
// Backward uses its own list with at most 2 vectors per thread (it holds x, dy, w and two
// accumulators per element; more would spill under the 64-register cap of a 1024-thread
// block) and 1024-thread blocks, one per multiprocessor (persistent): few blocks means a
// small dw/db workspace. First tried: 1024-thread blocks, one per multiprocessor (45-69% of
// copy bandwidth on H100); the next-row prefetch then spills under their 64-register cap, so
// the default is 512-thread blocks (up to 128 registers, several per multiprocessor);
// MEGAPAR_LN_BWD_THREADS=1024 selects the 1024-thread blocks for comparison.
#include <cstdlib>

#include "layernorm_kernels.cuh"

namespace megapar {
namespace {


#define MEGAPAR_TRY_BWD_SHAPE(W_, IT_)                                                \
  if (cols <= 32 * (W_) * (IT_) * vec) {                                              \
    f(std::integral_constant<int, W_>{}, std::integral_constant<int, IT_>{});         \
    return true;                                                                      \
  }

template <typename F>
bool dispatch_bwd_shape(int64_t cols, int vec, F&& f) {
  MEGAPAR_TRY_BWD_SHAPE(1, 1)
  MEGAPAR_TRY_BWD_SHAPE(2, 1)
  MEGAPAR_TRY_BWD_SHAPE(4, 1)
  MEGAPAR_TRY_BWD_SHAPE(8, 1)
  MEGAPAR_TRY_BWD_SHAPE(16, 1)
  MEGAPAR_TRY_BWD_SHAPE(16, 2)
  MEGAPAR_TRY_BWD_SHAPE(16, 4)
  return false;
}

int bwd_threads() {
  static const int bt = [] {
    const char* e = std::getenv("MEGAPAR_LN_BWD_THREADS");
    return (e != nullptr && std::atoi(e) == 1024) ? 1024 : 512;
  }();
  return bt;
}

template <typename T>
bool vec_ok(int h, std::initializer_list<const void*> ptrs) {
  if (h % (kVecBytes / sizeof(T)) != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned(p, kVecBytes)) return false;
  return true;
}

template <typename T>
const char* fwd(const void* x, const void* res, const void* w, const void* b, void* y, void* sum_out, float* mean,
                float* rstd, int64_t rows, int h, float eps, cudaStream_t stream) {
  constexpr int V = kVecBytes / sizeof(T);
  auto launch = [&](auto vc, auto wc, auto ic) {
    constexpr int VEC = decltype(vc)::value, W = decltype(wc)::value, IT = decltype(ic)::value;
    constexpr int RG = W >= 4 ? 1 : 4 / W;
    const int64_t blocks = (rows + RG - 1) / RG;
    layernorm_fwd_kernel<T, VEC, W, IT><<<static_cast<unsigned>(blocks), 32 * W * RG, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w), static_cast<const T*>(b),
        static_cast<T*>(y), static_cast<T*>(sum_out), mean, rstd, rows, h, eps);
  };
  bool ok;
  if (vec_ok<T>(h, {x, res, w, b, y, sum_out})) {
    ok = dispatch_fwd_shape(h, V, [&](auto wc, auto ic) { launch(std::integral_constant<int, V>{}, wc, ic); });
  } else {
    ok = dispatch_fwd_shape(h, 1, [&](auto wc, auto ic) { launch(std::integral_constant<int, 1>{}, wc, ic); });
  }
  if (!ok) return "layernorm: hidden size exceeds the kernel's register limit (see layernorm_max_cols)";
  return last_error();
}

// Calls f(kernel, rg, threads, smem_bytes) for the backward configuration of (T, h, vec).
template <typename T, typename F>
bool with_bwd_kernel(int h, bool vec, F&& f) {
  constexpr int V = kVecBytes / sizeof(T);
  auto pick = [&](auto vc, auto wc, auto ic, auto btc) {
    constexpr int VEC = decltype(vc)::value, W = decltype(wc)::value, IT = decltype(ic)::value;
    constexpr int BT = decltype(btc)::value < 32 * W ? 32 * W : decltype(btc)::value;
    constexpr int RG = BT / (32 * W);
    const size_t smem = RG > 1 ? sizeof(float2) * h : 0;
    f(layernorm_bwd_kernel<T, VEC, W, IT, BT>, RG, BT, smem);
  };
  auto by_vec = [&](auto vc) {
    return dispatch_bwd_shape(h, decltype(vc)::value, [&](auto wc, auto ic) {
      if (bwd_threads() == 512)
        pick(vc, wc, ic, std::integral_constant<int, 512>{});
      else
        pick(vc, wc, ic, std::integral_constant<int, 1024>{});
    });
  };
  return vec ? by_vec(std::integral_constant<int, V>{}) : by_vec(std::integral_constant<int, 1>{});
}

template <typename T>
int64_t bwd_groups(int64_t rows, int h, bool vec, int sm_count) {
  int64_t groups = 0;
  with_bwd_kernel<T>(h, vec, [&](auto kernel, int rg, int bt, size_t smem) {
    int per_sm = 0;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, bt, smem) != cudaSuccess || per_sm < 1) per_sm = 1;
    const int64_t needed = (rows + rg - 1) / rg;
    groups = std::max<int64_t>(1, std::min<int64_t>(needed, static_cast<int64_t>(per_sm) * sm_count));
  });
  return groups;
}

template <typename T>
const char* bwd(const void* dy, const void* x, const float* mean, const float* rstd, const void* w, const void* dres,
                void* dx, float* ws, int64_t groups, void* dw, void* db, int64_t rows, int h, cudaStream_t stream) {
  const bool vec = vec_ok<T>(h, {dy, x, w, dres, dx});
  const bool ok = with_bwd_kernel<T>(h, vec, [&](auto kernel, int rg, int bt, size_t smem) {
    (void)rg;
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    kernel<<<static_cast<unsigned>(groups), bt, smem, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, static_cast<const T*>(w),
        static_cast<const T*>(dres), static_cast<T*>(dx), ws, rows, h);
  });
  if (!ok) return "layernorm backward: hidden size exceeds the kernel's register limit";
  if (const char* e = last_error()) return e;
  layernorm_param_grad_kernel<T><<<static_cast<unsigned>((h + 31) / 32), dim3(32, 8), 0, stream>>>(
      ws, groups, h, static_cast<T*>(dw), static_cast<T*>(db));
  return last_error();
}

}  // namespace

int64_t layernorm_max_cols(DType dt, bool vectorized) {
  const int elem = dt == DType::kFloat32 ? 4 : 2;
  const int64_t v = vectorized ? kVecBytes / elem : 1;
  return std::min<int64_t>(max_fwd_cols(static_cast<int>(v)), 32 * 16 * 4 * v);
}

const char* layernorm_forward(const void* x, const void* residual, const void* w, const void* b, void* y,
                              void* sum_out, float* mean, float* rstd, int64_t rows, int h, float eps, DType dt,
                              cudaStream_t stream) {
  if (rows == 0) return nullptr;
  if ((residual == nullptr) != (sum_out == nullptr)) return "layernorm: residual and sum_out must both be given";
  switch (dt) {
    case DType::kFloat32: return fwd<float>(x, residual, w, b, y, sum_out, mean, rstd, rows, h, eps, stream);
    case DType::kFloat16: return fwd<__half>(x, residual, w, b, y, sum_out, mean, rstd, rows, h, eps, stream);
    case DType::kBFloat16: return fwd<__nv_bfloat16>(x, residual, w, b, y, sum_out, mean, rstd, rows, h, eps, stream);
  }
  return "layernorm: unsupported dtype";
}

// The workspace is sized before the pointers exist, so it assumes the vectorized path when h
// allows it; the launch re-checks pointer alignment and (rarely) takes the scalar path, whose
// grid is then limited to the same number of blocks.
int64_t layernorm_backward_groups(int64_t rows, int h, DType dt, int sm_count) {
  switch (dt) {
    case DType::kFloat32: return bwd_groups<float>(rows, h, h % 4 == 0, sm_count);
    case DType::kFloat16: return bwd_groups<__half>(rows, h, h % 8 == 0, sm_count);
    case DType::kBFloat16: return bwd_groups<__nv_bfloat16>(rows, h, h % 8 == 0, sm_count);
  }
  return 1;
}

const char* layernorm_backward(const void* dy, const void* x, const float* mean, const float* rstd, const void* w,
                               const void* dres, void* dx, float* workspace, int64_t groups, void* dw, void* db,
                               int64_t rows, int h, DType dt, cudaStream_t stream) {
  if (rows == 0) return "layernorm backward: zero rows (the binding handles this case)";
  switch (dt) {
    case DType::kFloat32: return bwd<float>(dy, x, mean, rstd, w, dres, dx, workspace, groups, dw, db, rows, h, stream);
    case DType::kFloat16: return bwd<__half>(dy, x, mean, rstd, w, dres, dx, workspace, groups, dw, db, rows, h, stream);
    case DType::kBFloat16:
      return bwd<__nv_bfloat16>(dy, x, mean, rstd, w, dres, dx, workspace, groups, dw, db, rows, h, stream);
  }
  return "layernorm backward: unsupported dtype";
}

}  // namespace megapar
