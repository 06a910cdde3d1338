// Shared device helpers for megapar's row-wise kernels (softmax, LayerNorm).
//
// Versions tried / why this one: every kernel here is a "row-wise" memory-bound kernel, so
// they share one shape: a row is owned by a group of W warps, each thread holds ITERS
// vectors of VEC elements in registers (16-byte loads when the row length allows), and row
// reductions are warp shuffles plus, for W > 1, one shared-memory exchange. An earlier
// sketch with a separate kernel per mask type and per row-length class multiplied the
// template instantiations (and the build time) without being faster, so masks and the
// causal limit are run-time arguments and only (dtype, VEC, W, ITERS) are templated.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launchers.h"

namespace megapar {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum (or max) over a row group of W warps. smem holds W floats per row group; every
// thread of the block must call this the same number of times when W > 1 (it syncs).
template <int W, bool IS_MAX>
__device__ __forceinline__ float group_reduce(float v, float* smem, int warp_in_group, int lane) {
  v = IS_MAX ? warp_max(v) : warp_sum(v);
  if constexpr (W > 1) {
    __syncthreads();  // the previous call's readers are done with smem
    if (lane == 0) smem[warp_in_group] = v;
    __syncthreads();
    v = smem[0];
#pragma unroll
    for (int i = 1; i < W; ++i) v = IS_MAX ? fmaxf(v, smem[i]) : v + smem[i];
  }
  return v;
}

// Two sums at once (one shared-memory round instead of two).
template <int W>
__device__ __forceinline__ void group_sum2(float& a, float& b, float2* smem, int warp_in_group, int lane) {
  a = warp_sum(a);
  b = warp_sum(b);
  if constexpr (W > 1) {
    __syncthreads();
    if (lane == 0) smem[warp_in_group] = make_float2(a, b);
    __syncthreads();
    float2 s = smem[0];
#pragma unroll
    for (int i = 1; i < W; ++i) {
      s.x += smem[i].x;
      s.y += smem[i].y;
    }
    a = s.x;
    b = s.y;
  }
}

// Calls f(integral_constant<W>, integral_constant<ITERS>) for the first (W, ITERS) row-group shape in the list
// that covers `cols` columns with vectors of `vec` elements; returns false when none does.
// (W, ITERS): 32*W threads per row, ITERS vectors per thread.
#define MEGAPAR_TRY_SHAPE(W_, IT_)                                  \
  if (cols <= 32 * (W_) * (IT_) * vec) {                            \
    f(std::integral_constant<int, W_>{}, std::integral_constant<int, IT_>{}); \
    return true;                                                    \
  }

// Row-wise kernels: one warp per row for short rows, up to 512 threads per row for long rows
// (W = 32 with ITERS = 4 would need more than the 64 registers a 1024-thread block allows).
template <typename F>
bool dispatch_fwd_shape(int64_t cols, int vec, F&& f) {
  MEGAPAR_TRY_SHAPE(1, 1)
  MEGAPAR_TRY_SHAPE(1, 2)
  MEGAPAR_TRY_SHAPE(1, 4)
  MEGAPAR_TRY_SHAPE(2, 4)
  MEGAPAR_TRY_SHAPE(4, 4)
  MEGAPAR_TRY_SHAPE(8, 4)
  MEGAPAR_TRY_SHAPE(16, 4)
  return false;
}

// Host-side helpers shared by the launchers.
constexpr int kVecBytes = 16;  // one vectorised access per thread

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline const char* last_error() {  // nullptr when the last launch succeeded
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

inline int64_t max_fwd_cols(int vec) { return 32 * 16 * 4 * static_cast<int64_t>(vec); }

}  // namespace megapar
