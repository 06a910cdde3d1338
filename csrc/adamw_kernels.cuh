// Multi-tensor AdamW over fixed tensor tables, writing the fp32 master weights, both moments and
// the model's bf16/fp16 copy of each parameter in one pass (see adamw.cu for why).
//
// Tables (built once by megapar/kernels/adamw.py; the tensors never move during a run):
//   tensors [n, kCols] int64: master*, grad*, exp_avg*, exp_avg_sq*, param* (0: no low-precision
//                             copy), numel, group, vec (1 when every pointer allows 16-byte
//                             fp32 / 8-byte bf16 vectors)
//   chunks  [c, 2]     int64: (tensor, first element); one thread block per chunk of kChunk elements
//   hyper   [G, 2]     fp32:  (lr, weight decay) per param group, refreshed on the device each step
//   step    [1]        fp32:  the step number of this update (already incremented)
//   grad_scale [1]     fp32 or nullptr: gradients are divided by it (global-norm clipping, fp16's loss scale)
//   found_inf  [1]     fp32 or nullptr: nonzero skips the update (an fp16 overflow found on the device)
#pragma once

#include "common.cuh"

namespace megapar {

constexpr int kAdamCols = 8;
constexpr int64_t kAdamChunk = 32768;  // elements per thread block
constexpr int kAdamThreads = 256;

struct AdamConsts {
  float beta1, beta2, eps;
};

// torch's fused AdamW arithmetic (decoupled weight decay, bias corrections in the step size).
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, float decay, float step_size,
                                             float bc2_sqrt, const AdamConsts& c) {
  p *= decay;
  m = c.beta1 * m + (1.f - c.beta1) * g;
  v = c.beta2 * v + (1.f - c.beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / bc2_sqrt + c.eps);
}

template <typename P>  // P: the model parameter type of the copy (float when there is none)
__global__ void __launch_bounds__(kAdamThreads) adamw_kernel(const int64_t* __restrict__ tensors,
                                                             const int64_t* __restrict__ chunks,
                                                             const float* __restrict__ hyper,
                                                             const float* __restrict__ step_ptr,
                                                             const float* __restrict__ grad_scale,
                                                             const float* __restrict__ found_inf, AdamConsts c) {
  if (found_inf != nullptr && *found_inf != 0.f) return;  // the whole update is skipped: nothing is written
  const int64_t* row = tensors + kAdamCols * chunks[2 * blockIdx.x];
  const int64_t start = chunks[2 * blockIdx.x + 1];
  float* __restrict__ p = reinterpret_cast<float*>(row[0]);
  const float* __restrict__ g = reinterpret_cast<const float*>(row[1]);
  float* __restrict__ m = reinterpret_cast<float*>(row[2]);
  float* __restrict__ v = reinterpret_cast<float*>(row[3]);
  P* __restrict__ q = reinterpret_cast<P*>(row[4]);
  const int64_t end = min(start + kAdamChunk, row[5]);
  const float lr = hyper[2 * row[6]], wd = hyper[2 * row[6] + 1];
  const float step = *step_ptr;
  const float step_size = lr / (1.f - powf(c.beta1, step));
  const float bc2_sqrt = sqrtf(1.f - powf(c.beta2, step));
  const float decay = 1.f - lr * wd;
  const float scale = grad_scale == nullptr ? 1.f : *grad_scale;

  int64_t i = start;
  if (row[7]) {  // 4 elements per access: 16-byte fp32, 8-byte bf16/fp16
    const int64_t nvec = (end - start) / 4;
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      const int64_t k = start + 4 * j;
      float pp[4], gg[4], mm[4], vv[4];
      load_vec<float, 4>(p + k, pp);
      load_vec<float, 4>(g + k, gg);
      load_vec<float, 4>(m + k, mm);
      load_vec<float, 4>(v + k, vv);
#pragma unroll
      for (int e = 0; e < 4; ++e) adamw_update(pp[e], gg[e] / scale, mm[e], vv[e], decay, step_size, bc2_sqrt, c);
      store_vec<float, 4>(p + k, pp);
      store_vec<float, 4>(m + k, mm);
      store_vec<float, 4>(v + k, vv);
      if (q != nullptr) store_vec<P, 4>(q + k, pp);
    }
    i = start + 4 * nvec;
  }
  for (i += threadIdx.x; i < end; i += blockDim.x) {  // unaligned tensors and the tail
    float pp = p[i], mm = m[i], vv = v[i];
    adamw_update(pp, g[i] / scale, mm, vv, decay, step_size, bc2_sqrt, c);
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
    if (q != nullptr) q[i] = from_float<P>(pp);
  }
}

}  // namespace megapar
