// Scaled (causal | boolean-masked) softmax, forward and backward, one row per group of W warps.
//
// Versions tried / why this one:
//  1. Megatron's layout (one warp per row, a separate kernel for each mask kind, rows up to
//     2048) was the starting point; long rows (4096+) then need a different kernel anyway.
//  2. This version: one template over the row-group shape (W warps x ITERS vectors per
//     thread, see common.cuh), the causal limit and the mask as run-time arguments. Causal
//     rows issue no loads at all above the diagonal (vectors wholly above it are skipped, the
//     vector that straddles it is read element by element) and write zeros there, so the
//     bytes moved are the lower triangle read plus the full row written. Rows live in
//     registers (one read, one write per element); max and sum use warp shuffles plus one
//     shared-memory round when W > 1. A fully masked row gives zeros instead of NaN.
#pragma once

#include "common.cuh"

namespace megapar {

// x, y: [rows, sk]; mask: nullptr or [mask_batches, sq, sk] (uint8, 1 = masked out).
template <typename T, int VEC, int W, int ITERS>
__global__ void __launch_bounds__(W >= 4 ? 32 * W : 128)
    softmax_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, const uint8_t* __restrict__ mask, int64_t rows,
                       int sq, int sk, int64_t rows_per_batch, int mask_batches, float scale, bool causal) {
  constexpr int GROUP = 32 * W;                     // threads per row
  constexpr int RG = W >= 4 ? 1 : 4 / W;            // rows per block
  __shared__ float smem[RG][W];
  const int lane = threadIdx.x % 32;
  const int rg = threadIdx.x / GROUP;
  const int t = threadIdx.x % GROUP;                 // thread index inside the row group
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RG + rg;
  const bool active = row < rows;                    // inactive groups still join the syncs
  const int r = active ? static_cast<int>(row % sq) : 0;
  const int valid = !active ? 0 : (causal ? min(r + 1, sk) : sk);
  const T* xr = x + (active ? row : 0) * sk;
  const uint8_t* mr = nullptr;
  if (mask != nullptr && active) {
    const int64_t mb = mask_batches == 1 ? 0 : row / rows_per_batch;
    mr = mask + (mb * sq + r) * static_cast<int64_t>(sk);
  }

  float v[ITERS][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (c0 + VEC <= valid) {
      load_vec<T, VEC>(xr + c0, v[it]);
      if (mr != nullptr) {
        const Vec<uint8_t, VEC> m = *reinterpret_cast<const Vec<uint8_t, VEC>*>(mr + c0);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[it][i] = m.v[i] ? -INFINITY : v[it][i] * scale;
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[it][i] *= scale;
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int c = c0 + i;
        const bool ok = c < valid && (mr == nullptr || !mr[c]);
        v[it][i] = ok ? to_float(xr[c]) * scale : -INFINITY;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) mx = fmaxf(mx, v[it][i]);
  }
  mx = group_reduce<W, true>(mx, smem[rg], t / 32, lane);

  float sum = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      // exp(-inf - m) = 0 for masked columns; the guard also covers a fully masked row (m = -inf).
      v[it][i] = v[it][i] == -INFINITY ? 0.f : __expf(v[it][i] - mx);
      sum += v[it][i];
    }
  sum = group_reduce<W, false>(sum, smem[rg], t / 32, lane);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;

  if (!active) return;
  T* yr = y + row * sk;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[it][i] *= inv;
    if (c0 + VEC <= sk) {
      store_vec<T, VEC>(yr + c0, v[it]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (c0 + i < sk) yr[c0 + i] = from_float<T>(v[it][i]);
    }
  }
}

// dx = scale * y * (dy - sum(y * dy)); causal rows read only columns 0..r and write zeros above.
template <typename T, int VEC, int W, int ITERS>
__global__ void __launch_bounds__(W >= 4 ? 32 * W : 128)
    softmax_bwd_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, int64_t rows, int sq,
                       int sk, float scale, bool causal) {
  constexpr int GROUP = 32 * W;
  constexpr int RG = W >= 4 ? 1 : 4 / W;
  __shared__ float smem[RG][W];
  const int lane = threadIdx.x % 32;
  const int rg = threadIdx.x / GROUP;
  const int t = threadIdx.x % GROUP;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RG + rg;
  const bool active = row < rows;
  const int r = active ? static_cast<int>(row % sq) : 0;
  const int valid = !active ? 0 : (causal ? min(r + 1, sk) : sk);
  const T* yr = y + (active ? row : 0) * sk;
  const T* dyr = dy + (active ? row : 0) * sk;

  float p[ITERS][VEC], g[ITERS][VEC];
  float dot = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (c0 + VEC <= valid) {
      load_vec<T, VEC>(yr + c0, p[it]);
      load_vec<T, VEC>(dyr + c0, g[it]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const bool ok = c0 + i < valid;
        p[it][i] = ok ? to_float(yr[c0 + i]) : 0.f;
        g[it][i] = ok ? to_float(dyr[c0 + i]) : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += p[it][i] * g[it][i];
  }
  dot = group_reduce<W, false>(dot, smem[rg], t / 32, lane);

  if (!active) return;
  T* dxr = dx + row * sk;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[it][i] = scale * p[it][i] * (g[it][i] - dot);
    if (c0 + VEC <= sk) {
      store_vec<T, VEC>(dxr + c0, p[it]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (c0 + i < sk) dxr[c0 + i] = from_float<T>(p[it][i]);
    }
  }
}

}  // namespace megapar
