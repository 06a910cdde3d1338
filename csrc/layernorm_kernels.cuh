// LayerNorm forward (optionally fused with a residual add) and backward, fp32 math for
// fp32 / fp16 / bf16 tensors; weight and bias have the input's dtype.
//
// Versions tried / why this one:
//  1. Apex-style: one block per row with a Welford reduction and a column-parallel second
//     kernel re-reading x and dy for the weight/bias gradients. That re-read costs 2 extra
//     bytes/element of the 6 the backward must move, so it cannot reach the target.
//  2. This version (an attempt to load w/b before the reductions made the forward slower:
//     82% -> 60% of copy bandwidth at 8192x8192 on H100, so it was reverted). Forward: a row group of W warps keeps the row in registers (16-byte
//     loads), two-pass mean/variance in registers (exact, no Welford merge), writes y and the
//     fp32 mean / reciprocal std. Backward: a persistent grid (as many blocks as fit at once);
//     every thread keeps the same columns for all the rows it visits, so the dw/db partial
//     sums stay in registers. Stage one reduces them across the block's row groups in shared
//     memory (in a fixed order: deterministic) and writes one fp32 partial row pair per block;
//     stage two sums the partials per column. The workspace is blocks x 2 x h fp32, a few
//     percent of the bytes of a large backward.
#pragma once

#include "common.cuh"

namespace megapar {

// x, residual, sum_out, y: [rows, h]; w, b: [h]; mean, rstd: [rows] fp32.
template <typename T, int VEC, int W, int ITERS>
__global__ void __launch_bounds__(W >= 4 ? 32 * W : 128)
    layernorm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ w,
                         const T* __restrict__ b, T* __restrict__ y, T* __restrict__ sum_out, float* __restrict__ mean,
                         float* __restrict__ rstd, int64_t rows, int h, float eps) {
  constexpr int GROUP = 32 * W;
  constexpr int RG = W >= 4 ? 1 : 4 / W;
  __shared__ float smem[RG][W];
  const int lane = threadIdx.x % 32;
  const int rg = threadIdx.x / GROUP;
  const int t = threadIdx.x % GROUP;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * RG + rg;
  const bool active = row < rows;
  const int valid = active ? h : 0;
  const int64_t off = (active ? row : 0) * h;

  // w and b are loaded (raw) before the reductions so that their latency overlaps them.
  Vec<T, VEC> wr[ITERS], br[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (VEC > 1 && c0 + VEC <= h) {
      wr[it] = *reinterpret_cast<const Vec<T, VEC>*>(w + c0);
      br[it] = *reinterpret_cast<const Vec<T, VEC>*>(b + c0);
    }
  }
  float v[ITERS][VEC];
  float s = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (c0 + VEC <= valid) {
      load_vec<T, VEC>(x + off + c0, v[it]);
      if (residual != nullptr) {
        float r[VEC];
        load_vec<T, VEC>(residual + off + c0, r);
#pragma unroll  // round the sum to T: the saved sum is exactly what gets normalized
        for (int i = 0; i < VEC; ++i) v[it][i] = to_float(from_float<T>(v[it][i] + r[i]));
        store_vec<T, VEC>(sum_out + off + c0, v[it]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int c = c0 + i;
        float a = c < valid ? to_float(x[off + c]) : 0.f;
        if (residual != nullptr && c < valid) {
          a = to_float(from_float<T>(a + to_float(residual[off + c])));
          sum_out[off + c] = from_float<T>(a);
        }
        v[it][i] = a;
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) s += v[it][i];
  }
  const float mu = group_reduce<W, false>(s, smem[rg], t / 32, lane) / h;
  float q = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = (it * GROUP + t) * VEC + i < valid ? v[it][i] - mu : 0.f;
      q += d * d;
    }
  const float rs = rsqrtf(group_reduce<W, false>(q, smem[rg], t / 32, lane) / h + eps);
  if (!active) return;
  if (t == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (VEC > 1 && c0 + VEC <= h) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[it][i] = (v[it][i] - mu) * rs * to_float(wr[it].v[i]) + to_float(br[it].v[i]);
      store_vec<T, VEC>(y + off + c0, v[it]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int c = c0 + i;
        if (c < h) y[off + c] = from_float<T>((v[it][i] - mu) * rs * to_float(w[c]) + to_float(b[c]));
      }
    }
  }
}

// Persistent backward. Block = RG row groups of W warps (BT threads); the grid strides over
// rows in steps of gridDim.x * RG (the same trip count for every group: the syncs match).
// workspace: [gridDim.x, 2, h] fp32 partial (dw, db) sums.
template <typename T, int VEC, int W, int ITERS, int BT>
__global__ void __launch_bounds__(BT)
    layernorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                         const float* __restrict__ rstd, const T* __restrict__ w, const T* __restrict__ dres,
                         T* __restrict__ dx, float* __restrict__ workspace, int64_t rows, int h) {
  constexpr int GROUP = 32 * W;
  constexpr int RG = BT / GROUP;
  __shared__ float2 smem[RG][W];
  extern __shared__ float2 part[];  // [h] (dw, db) block partials, used when RG > 1
  const int lane = threadIdx.x % 32;
  const int rg = threadIdx.x / GROUP;
  const int t = threadIdx.x % GROUP;
  const float inv_h = 1.f / h;

  float wv[ITERS][VEC], adw[ITERS][VEC], adb[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c0 = (it * GROUP + t) * VEC;
    if (c0 + VEC <= h) {
      load_vec<T, VEC>(w + c0, wv[it]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) wv[it][i] = c0 + i < h ? to_float(w[c0 + i]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) adw[it][i] = adb[it][i] = 0.f;
  }

  // Rows are software-pipelined: the next row's x and dy (raw, 16-byte vectors) are in flight
  // while this row is reduced and written.
  using RawV = Vec<T, VEC>;
  auto fetch = [&](int64_t row, RawV (&ax)[ITERS], RawV (&ag)[ITERS], float& mu, float& rs) {
    const bool act = row < rows;
    const int64_t off = (act ? row : 0) * h;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c0 = (it * GROUP + t) * VEC;
      if (act && c0 < h) {  // VEC > 1 only when h % VEC == 0: a vector is all in or all out
        ax[it] = *reinterpret_cast<const RawV*>(x + off + c0);
        ag[it] = *reinterpret_cast<const RawV*>(dy + off + c0);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) ax[it].v[i] = ag[it].v[i] = from_float<T>(0.f);
      }
    }
    mu = act ? mean[row] : 0.f;
    rs = act ? rstd[row] : 0.f;
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * RG;
  RawV cx[ITERS], cg[ITERS];
  float mu, rs;
  fetch(static_cast<int64_t>(blockIdx.x) * RG + rg, cx, cg, mu, rs);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RG; base < rows; base += stride) {
    const int64_t row = base + rg;
    const bool active = row < rows;
    const int64_t off = (active ? row : 0) * h;
    RawV nx[ITERS], ng[ITERS];
    float mu_n, rs_n;
    fetch(row + stride, nx, ng, mu_n, rs_n);
    float xh[ITERS][VEC], g[ITERS][VEC];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        // columns past h have dy = 0, so they add nothing to s1, s2 (their dw/db are dropped)
        xh[it][i] = (to_float(cx[it].v[i]) - mu) * rs;
        g[it][i] = to_float(cg[it].v[i]);
        adw[it][i] += g[it][i] * xh[it][i];
        adb[it][i] += g[it][i];
        g[it][i] *= wv[it][i];  // now w * dy
        s1 += g[it][i];
        s2 += g[it][i] * xh[it][i];
      }
    }
    group_sum2<W>(s1, s2, smem[rg], t / 32, lane);
    if (active) {
      s1 *= inv_h;
      s2 *= inv_h;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c0 = (it * GROUP + t) * VEC;
        float d[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) d[i] = rs * (g[it][i] - s1 - xh[it][i] * s2);
        if (c0 < h) {
          if (dres != nullptr) {
            float e[VEC];
            load_vec<T, VEC>(dres + off + c0, e);
#pragma unroll
            for (int i = 0; i < VEC; ++i) d[i] += e[i];
          }
          store_vec<T, VEC>(dx + off + c0, d);
        }
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      cx[it] = nx[it];
      cg[it] = ng[it];
    }
    mu = mu_n;
    rs = rs_n;
  }

  // Stage one: block partials. RG > 1: row groups add into shared memory one after another.
  float* out = workspace + static_cast<int64_t>(blockIdx.x) * 2 * h;
  if constexpr (RG == 1) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int c = (it * GROUP + t) * VEC + i;
        if (c < h) {
          out[c] = adw[it][i];
          out[h + c] = adb[it][i];
        }
      }
  } else {
    for (int k = 0; k < RG; ++k) {
      if (rg == k) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const int c = (it * GROUP + t) * VEC + i;
            if (c < h) {
              const float2 p = k == 0 ? make_float2(0.f, 0.f) : part[c];
              part[c] = make_float2(p.x + adw[it][i], p.y + adb[it][i]);
            }
          }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < h; c += BT) {
      out[c] = part[c].x;
      out[h + c] = part[c].y;
    }
  }
}

// Stage two: dw[c] = sum_g workspace[g, 0, c], db[c] = sum_g workspace[g, 1, c].
// Block (32, 8): 32 columns, 8 row strides, fixed summation order.
template <typename T>
__global__ void __launch_bounds__(256)
    layernorm_param_grad_kernel(const float* __restrict__ workspace, int64_t groups, int h, T* __restrict__ dw,
                                T* __restrict__ db) {
  __shared__ float sw[8][33], sb[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f, b = 0.f;
  if (c < h) {
    for (int64_t g = threadIdx.y; g < groups; g += 8) {
      a += workspace[g * 2 * h + c];
      b += workspace[g * 2 * h + h + c];
    }
  }
  sw[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
#pragma unroll
    for (int k = 1; k < 8; ++k) {
      a += sw[k][threadIdx.x];
      b += sb[k][threadIdx.x];
    }
    dw[c] = from_float<T>(a);
    db[c] = from_float<T>(b);
  }
}

}  // namespace megapar
