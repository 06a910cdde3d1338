// Host-side entry points of the CUDA kernels: raw pointers, sizes and a stream, no torch
// types, so the .cu files compile quickly with nvcc alone and all tensor checks live in the
// pybind11 binding (megapar_kernels.cpp). Each launcher returns nullptr on success or a
// static message describing why it could not run (unsupported size, launch error).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megapar {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Largest row length (softmax keys / LayerNorm hidden size) the kernels hold in registers.
int64_t softmax_max_cols(DType dt, bool vectorized);
int64_t layernorm_max_cols(DType dt, bool vectorized);

// probs = softmax(scale * x) over the last dim of rows = b*np*sq rows of sk elements.
// mask: nullptr or uint8 [mask_batches, sq, sk] (1 = masked out), mask_batches in {1, b};
// rows_per_batch = np*sq. causal (sq == sk): row r of each [sq, sk] block reads columns
// 0..r only and writes zeros above. A row with every column masked gives zeros.
const char* softmax_forward(const void* x, void* y, const uint8_t* mask, int64_t rows, int sq, int sk,
                            int64_t rows_per_batch, int mask_batches, float scale, bool causal, DType dt,
                            cudaStream_t stream);

// dx = scale * y * (dy - sum(dy * y)); causal rows read y/dy below the diagonal only.
const char* softmax_backward(const void* y, const void* dy, void* dx, int64_t rows, int sq, int sk, float scale,
                             bool causal, DType dt, cudaStream_t stream);

// y = (s - mean) * rstd * w + b with s = x (+ residual); mean/rstd are fp32 [rows].
// residual and sum_out are both nullptr or both set (sum_out = x + residual, rounded to dt).
const char* layernorm_forward(const void* x, const void* residual, const void* w, const void* b, void* y,
                              void* sum_out, float* mean, float* rstd, int64_t rows, int h, float eps, DType dt,
                              cudaStream_t stream);

// Rows of the fp32 [groups, 2, h] workspace that layernorm_backward needs (stage one of the
// two-stage weight/bias-gradient reduction writes one partial row pair per thread block).
int64_t layernorm_backward_groups(int64_t rows, int h, DType dt, int sm_count);

// dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)) (+ dres); dw = sum dy*xhat, db = sum dy.
const char* layernorm_backward(const void* dy, const void* x, const float* mean, const float* rstd, const void* w,
                               const void* dres, void* dx, float* workspace, int64_t groups, void* dw, void* db,
                               int64_t rows, int h, DType dt, cudaStream_t stream);

// AdamW over the tensor tables of adamw_kernels.cuh (one launch, n_chunks thread blocks):
// fp32 masters and moments updated in place, the model's copy written in param_dtype
// (kFloat32: no copy). hyper is fp32 [groups, 2] = (lr, weight decay), step fp32 [1] (already
// incremented), grad_scale nullptr or fp32 [1] (gradients are divided by it), found_inf nullptr or
// fp32 [1] (nonzero: nothing is updated; the caller keeps the step number).
int64_t adamw_chunk_elems();
int adamw_table_cols();
const char* adamw_step(const int64_t* tensors, const int64_t* chunks, int64_t n_chunks, const float* hyper,
                       const float* step, const float* grad_scale, const float* found_inf, float beta1, float beta2, float eps,
                       DType param_dtype, cudaStream_t stream);

}  // namespace megapar
