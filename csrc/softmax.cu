// Launchers for the scaled causal / masked softmax kernels (softmax_kernels.cuh).
//
// Versions tried / why this one: the launcher picks the row-group shape from the row length
// (common.cuh's list) and uses 16-byte vectors when the row length and the pointers allow it,
// scalar accesses otherwise (odd lengths such as 17 or 1000), so any shape up to the register
// limit is served by the same code. Dispatch is a switch over a handful of instantiations to
// keep build time modest (3 dtypes x 2 vector widths x 8 shapes, forward and backward).
#include "softmax_kernels.cuh"

namespace megapar {
namespace {

// Calls launch(vector width, warps, iterations) with the row shape that serves `cols` elements,
// 16-byte vectors when `vec` allows them; false when the row is too long for the registers.
template <int V, typename Launch>
bool dispatch_row(int64_t cols, bool vec, Launch&& launch) {
  if (vec) return dispatch_fwd_shape(cols, V, [&](auto w, auto i) { launch(std::integral_constant<int, V>{}, w, i); });
  const int vec1 = 1;
  return dispatch_fwd_shape(cols, vec1, [&](auto w, auto i) { launch(std::integral_constant<int, 1>{}, w, i); });
}

template <typename T>
const char* fwd(const void* x, void* y, const uint8_t* mask, int64_t rows, int sq, int sk, int64_t rows_per_batch,
                int mask_batches, float scale, bool causal, cudaStream_t stream) {
  constexpr int V = kVecBytes / sizeof(T);
  const bool vec = sk % V == 0 && aligned(x, kVecBytes) && aligned(y, kVecBytes) && (mask == nullptr || aligned(mask, V));
  auto launch = [&](auto vc, auto wc, auto ic) {
    constexpr int VEC = decltype(vc)::value, W = decltype(wc)::value, IT = decltype(ic)::value;
    constexpr int RG = W >= 4 ? 1 : 4 / W;
    const int64_t blocks = (rows + RG - 1) / RG;
    softmax_fwd_kernel<T, VEC, W, IT><<<static_cast<unsigned>(blocks), 32 * W * RG, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), mask, rows, sq, sk, rows_per_batch, mask_batches, scale,
        causal);
  };
  const bool ok = dispatch_row<V>(sk, vec, launch);
  if (!ok) return "softmax: row length exceeds the kernel's register limit (see softmax_max_cols)";
  return last_error();
}

template <typename T>
const char* bwd(const void* y, const void* dy, void* dx, int64_t rows, int sq, int sk, float scale, bool causal,
                cudaStream_t stream) {
  constexpr int V = kVecBytes / sizeof(T);
  const bool vec = sk % V == 0 && aligned(y, kVecBytes) && aligned(dy, kVecBytes) && aligned(dx, kVecBytes);
  auto launch = [&](auto vc, auto wc, auto ic) {
    constexpr int VEC = decltype(vc)::value, W = decltype(wc)::value, IT = decltype(ic)::value;
    constexpr int RG = W >= 4 ? 1 : 4 / W;
    const int64_t blocks = (rows + RG - 1) / RG;
    softmax_bwd_kernel<T, VEC, W, IT><<<static_cast<unsigned>(blocks), 32 * W * RG, 0, stream>>>(
        static_cast<const T*>(y), static_cast<const T*>(dy), static_cast<T*>(dx), rows, sq, sk, scale, causal);
  };
  const bool ok = dispatch_row<V>(sk, vec, launch);
  if (!ok) return "softmax backward: row length exceeds the kernel's register limit";
  return last_error();
}

}  // namespace

int64_t softmax_max_cols(DType dt, bool vectorized) {
  const int elem = dt == DType::kFloat32 ? 4 : 2;
  return max_fwd_cols(vectorized ? kVecBytes / elem : 1);
}

const char* softmax_forward(const void* x, void* y, const uint8_t* mask, int64_t rows, int sq, int sk,
                            int64_t rows_per_batch, int mask_batches, float scale, bool causal, DType dt,
                            cudaStream_t stream) {
  if (rows == 0) return nullptr;
  switch (dt) {
    case DType::kFloat32: return fwd<float>(x, y, mask, rows, sq, sk, rows_per_batch, mask_batches, scale, causal, stream);
    case DType::kFloat16: return fwd<__half>(x, y, mask, rows, sq, sk, rows_per_batch, mask_batches, scale, causal, stream);
    case DType::kBFloat16:
      return fwd<__nv_bfloat16>(x, y, mask, rows, sq, sk, rows_per_batch, mask_batches, scale, causal, stream);
  }
  return "softmax: unsupported dtype";
}

const char* softmax_backward(const void* y, const void* dy, void* dx, int64_t rows, int sq, int sk, float scale,
                             bool causal, DType dt, cudaStream_t stream) {
  if (rows == 0) return nullptr;
  switch (dt) {
    case DType::kFloat32: return bwd<float>(y, dy, dx, rows, sq, sk, scale, causal, stream);
    case DType::kFloat16: return bwd<__half>(y, dy, dx, rows, sq, sk, scale, causal, stream);
    case DType::kBFloat16: return bwd<__nv_bfloat16>(y, dy, dx, rows, sq, sk, scale, causal, stream);
  }
  return "softmax backward: unsupported dtype";
}

}  // namespace megapar
