// CUDA kernels for flowkit::flow_attention[_backward]; same contract as flow_attention_cpu.cpp.
// A task is one (b, s, kv head) with R = F·G query rows; its visible keys are context [0, len) then the F flow keys.
// Shared memory per block is bounded whatever R, F and the context length are:
// - forward and dQ: a block takes at most kMaxRowsPerBlock of a task's query rows (one row per warp at a time) and
//   streams the keys through shared tiles of kTile, one key per lane (online softmax in the forward);
// - dK/dV of the flow keys, the mirror image: a block takes at most kMaxKeysPerBlock flow keys (one per warp) and
//   streams the task's query rows through shared tiles of kTile, one row per lane. Each gradient element is summed
//   by one warp in a fixed order: no atomics, the same result on every run.
// Shared rows have an odd stride (head_dim | 1 elements), so the 32 lanes of a warp that read one column of 32
// different rows (the q·k and dO·v dot products) hit 32 different banks; a stride of head_dim = 128 put them all in
// one bank (32-way conflicts).
// ATen's per-operator headers instead of ATen/ATen.h (every op's declaration): ~40% less for nvcc's three passes
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "../cuda_utils.cuh"
#include "flow_attention_inputs.h"

namespace flowkit {
namespace {

using Dims = FlowAttentionDims;

constexpr int kTile = 32;  // keys (forward, dQ) or query rows (dK/dV) per shared tile: one per lane
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxRowsPerBlock = 16;  // query rows per block (forward, dQ): 4 per warp
constexpr int64_t kMaxKeysPerBlock = 16;  // flow keys per block (dK/dV): 4 per warp
constexpr int64_t kDefaultSharedBytes = 48 * 1024;  // more dynamic shared memory needs an opt-in per kernel

__host__ __device__ __forceinline__ int64_t shared_stride(int64_t head_dim) { return head_dim | 1; }

// A block's task (b, s, kv head), its prefix length, and the first of the `per_block` items (query rows or flow
// keys) of the task it handles; blocks are task-major, ceil(items / per_block) per task.
struct Task {
  int64_t b, s, kvh, len, first;
};

// Index arithmetic divides in 32 bits: the grid, a task's items and the head counts are < 2^31 (plan_blocks checks),
// and a 64-bit division is a called subroutine whose ABI made ptxas spill registers around it.
__device__ __forceinline__ Task block_task(const Dims& d, const int64_t* lens, int64_t items, int64_t per_block) {
  const unsigned tiles = (unsigned(items) + unsigned(per_block) - 1) / unsigned(per_block), block = blockIdx.x;
  const unsigned task = block / tiles, kv_heads = unsigned(d.kv_heads), steps = unsigned(d.steps);
  Task t;
  t.first = int64_t(block % tiles) * per_block;
  t.kvh = task % kv_heads;
  t.s = (task / kv_heads) % steps;
  t.b = (task / kv_heads) / steps;
  t.len = min(max(lens[t.b * d.steps + t.s], int64_t(0)), d.context);
  return t;
}

// Row r = f·G + g of the task's queries is q[b, s, f, kvh·G + g].
__device__ __forceinline__ int64_t query_row(const Dims& d, const Task& t, int64_t r) {
  const unsigned row = unsigned(r), group = unsigned(d.group);
  return ((t.b * d.steps + t.s) * d.flow + row / group) * d.heads + t.kvh * d.group + row % group;
}

// Flow key f of the task is flow_k[b, s, f, kvh].
__device__ __forceinline__ int64_t flow_key_row(const Dims& d, const Task& t, int64_t f) {
  return ((t.b * d.steps + t.s) * d.flow + f) * d.kv_heads + t.kvh;
}

// Keys [start, start + kTile) of the task into shared tiles (zeros past the last key).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_key_tile(const Dims& d, const Task& t, const scalar_t* ck, const scalar_t* cv,
                              const scalar_t* fk, const scalar_t* fv, int64_t start, acc_t* k_tile, acc_t* v_tile) {
  const int64_t keys = t.len + d.flow, dh = d.head_dim, stride = shared_stride(dh);
  for (unsigned e = threadIdx.x; e < unsigned(kTile * dh); e += blockDim.x) {
    const unsigned jj = e / unsigned(dh), i = e % unsigned(dh);
    const int64_t j = start + jj;
    acc_t k = acc_t(0), v = acc_t(0);
    if (j < t.len) {
      const int64_t off = ((t.b * d.kv_heads + t.kvh) * d.context + j) * dh + i;
      k = static_cast<acc_t>(ck[off]);
      v = static_cast<acc_t>(cv[off]);
    } else if (j < keys) {
      const int64_t off = flow_key_row(d, t, j - t.len) * dh + i;
      k = static_cast<acc_t>(fk[off]);
      v = static_cast<acc_t>(fv[off]);
    }
    k_tile[jj * stride + i] = k;
    v_tile[jj * stride + i] = v;
  }
}

// `count` query rows of the task from row `first`, each times `scale`, into shared rows (zeros past row R); a warp
// per row, so the row's offset (a 64-bit division) is computed once per row, not per element.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_query_rows(const Dims& d, const Task& t, const scalar_t* src, int64_t first,
                                                int64_t count, acc_t scale, acc_t* dst) {
  const int64_t rows = d.flow * d.group, dh = d.head_dim, stride = shared_stride(dh);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t r = warp; r < count; r += kWarps) {
    acc_t* row = dst + r * stride;
    if (first + r < rows) {
      const scalar_t* src_row = src + query_row(d, t, first + r) * dh;
      for (int64_t i = lane; i < dh; i += 32) row[i] = static_cast<acc_t>(src_row[i]) * scale;
    } else {
      for (int64_t i = lane; i < dh; i += 32) row[i] = acc_t(0);
    }
  }
}

template <typename acc_t>
__device__ __forceinline__ void zero_rows(int64_t count, int64_t dh, acc_t* dst) {
  const int64_t stride = shared_stride(dh);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t r = warp; r < count; r += kWarps)
    for (int64_t i = lane; i < dh; i += 32) dst[r * stride + i] = acc_t(0);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    flow_attention_fwd_kernel(const scalar_t* q, const scalar_t* fk, const scalar_t* fv, const scalar_t* ck,
                              const scalar_t* cv, const int64_t* lens, scalar_t* out, at::opmath_type<scalar_t>* lse,
                              Dims d, int64_t rows_per_block, at::opmath_type<scalar_t> scale) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t dh = d.head_dim, stride = shared_stride(dh), task_rows = d.flow * d.group;
  const Task t = block_task(d, lens, task_rows, rows_per_block);
  const int64_t rows = min(rows_per_block, task_rows - t.first);  // this block's rows: t.first + [0, rows)
  acc_t* q_s = reinterpret_cast<acc_t*>(smem_raw);  // (rows_per_block, stride), pre-scaled
  acc_t* acc_s = q_s + rows_per_block * stride;     // (rows_per_block, stride)
  acc_t* k_tile = acc_s + rows_per_block * stride;  // (kTile, stride)
  acc_t* v_tile = k_tile + kTile * stride;          // (kTile, stride)
  acc_t* m_s = v_tile + kTile * stride;             // (rows_per_block,)
  acc_t* l_s = m_s + rows_per_block;                // (rows_per_block,)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  load_query_rows(d, t, q, t.first, rows, scale, q_s);
  zero_rows(rows, dh, acc_s);
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    m_s[r] = -INFINITY;
    l_s[r] = acc_t(0);
  }
  const int64_t keys = t.len + d.flow;
  for (int64_t start = 0; start < keys; start += kTile) {
    __syncthreads();
    load_key_tile(d, t, ck, cv, fk, fv, start, k_tile, v_tile);
    __syncthreads();
    for (int64_t r = warp; r < rows; r += kWarps) {
      const acc_t* qr = q_s + r * stride;
      const bool visible = start + lane < keys;
      acc_t score = -INFINITY;
      if (visible) {
        score = acc_t(0);
        for (int64_t i = 0; i < dh; ++i) score += qr[i] * k_tile[lane * stride + i];
      }
      const acc_t m_old = m_s[r];
      const acc_t m_new = max(m_old, warp_max(score));
      const acc_t p = visible ? exp(score - m_new) : acc_t(0);
      const acc_t alpha = exp(m_old - m_new);
      const acc_t p_sum = warp_sum(p);
      acc_t* ar = acc_s + r * stride;
      for (int64_t i = lane; i < dh; i += 32) ar[i] *= alpha;
      for (int jj = 0; jj < kTile; ++jj) {
        const acc_t pj = __shfl_sync(0xffffffffu, p, jj);
        for (int64_t i = lane; i < dh; i += 32) ar[i] += pj * v_tile[jj * stride + i];
      }
      __syncwarp();
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + p_sum;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int64_t r = warp; r < rows; r += kWarps) {
    scalar_t* out_row = out + query_row(d, t, t.first + r) * dh;
    for (int64_t i = lane; i < dh; i += 32) out_row[i] = static_cast<scalar_t>(acc_s[r * stride + i] / l_s[r]);
  }
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) lse[query_row(d, t, t.first + r)] = m_s[r] + log(l_s[r]);
}

// dQ of a block's query rows; also writes delta = rowsum(dO ⊙ O) per row for the dK/dV kernel that runs next.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    flow_attention_dq_kernel(const scalar_t* grad, const scalar_t* q, const scalar_t* fk, const scalar_t* fv,
                             const scalar_t* ck, const scalar_t* cv, const int64_t* lens, const scalar_t* out,
                             const at::opmath_type<scalar_t>* lse, at::opmath_type<scalar_t>* delta, scalar_t* dq,
                             Dims d, int64_t rows_per_block, at::opmath_type<scalar_t> scale) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t dh = d.head_dim, stride = shared_stride(dh), task_rows = d.flow * d.group;
  const Task t = block_task(d, lens, task_rows, rows_per_block);
  const int64_t rows = min(rows_per_block, task_rows - t.first);
  acc_t* q_s = reinterpret_cast<acc_t*>(smem_raw);  // (rows_per_block, stride), pre-scaled
  acc_t* do_s = q_s + rows_per_block * stride;      // (rows_per_block, stride)
  acc_t* dq_s = do_s + rows_per_block * stride;     // (rows_per_block, stride)
  acc_t* k_tile = dq_s + rows_per_block * stride;   // (kTile, stride)
  acc_t* v_tile = k_tile + kTile * stride;          // (kTile, stride)
  acc_t* delta_s = v_tile + kTile * stride;         // (rows_per_block,)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  load_query_rows(d, t, q, t.first, rows, scale, q_s);
  load_query_rows(d, t, grad, t.first, rows, acc_t(1), do_s);
  zero_rows(rows, dh, dq_s);
  __syncthreads();
  for (int64_t r = warp; r < rows; r += kWarps) {
    const int64_t row = query_row(d, t, t.first + r);
    acc_t partial = acc_t(0);
    for (int64_t i = lane; i < dh; i += 32) partial += do_s[r * stride + i] * static_cast<acc_t>(out[row * dh + i]);
    partial = warp_sum(partial);
    if (lane == 0) {
      delta_s[r] = partial;
      delta[row] = partial;
    }
  }
  const int64_t keys = t.len + d.flow;
  for (int64_t start = 0; start < keys; start += kTile) {
    __syncthreads();
    load_key_tile(d, t, ck, cv, fk, fv, start, k_tile, v_tile);
    __syncthreads();
    for (int64_t r = warp; r < rows; r += kWarps) {
      const acc_t row_lse = lse[query_row(d, t, t.first + r)];
      acc_t ds = acc_t(0);
      if (start + lane < keys) {
        acc_t score = acc_t(0), dp = acc_t(0);
        for (int64_t i = 0; i < dh; ++i) {
          score += q_s[r * stride + i] * k_tile[lane * stride + i];
          dp += do_s[r * stride + i] * v_tile[lane * stride + i];
        }
        ds = exp(score - row_lse) * (dp - delta_s[r]);
      }
      for (int jj = 0; jj < kTile; ++jj) {
        const acc_t dsj = __shfl_sync(0xffffffffu, ds, jj);
        for (int64_t i = lane; i < dh; i += 32) dq_s[r * stride + i] += dsj * k_tile[jj * stride + i];
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int64_t r = warp; r < rows; r += kWarps) {  // a warp per row, as the dK/dV kernel stores
    const int64_t row = query_row(d, t, t.first + r) * dh;
    for (int64_t i = lane; i < dh; i += 32) dq[row + i] = static_cast<scalar_t>(dq_s[r * stride + i] * scale);
  }
}

// dK (w.r.t. the unscaled scores: Σ_r ds·q_scaled) and dV (Σ_r p·dO) of a block's flow keys over all R query rows
// of the task: every query row sees every flow key.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    flow_attention_dkv_kernel(const scalar_t* grad, const scalar_t* q, const scalar_t* fk, const scalar_t* fv,
                              const int64_t* lens, const at::opmath_type<scalar_t>* lse,
                              const at::opmath_type<scalar_t>* delta, scalar_t* dfk, scalar_t* dfv, Dims d,
                              int64_t keys_per_block, at::opmath_type<scalar_t> scale) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t dh = d.head_dim, stride = shared_stride(dh), task_rows = d.flow * d.group;
  const Task t = block_task(d, lens, d.flow, keys_per_block);
  const int64_t keys = min(keys_per_block, d.flow - t.first);  // this block's flow keys: t.first + [0, keys)
  acc_t* k_s = reinterpret_cast<acc_t*>(smem_raw);  // (keys_per_block, stride)
  acc_t* v_s = k_s + keys_per_block * stride;
  acc_t* dk_s = v_s + keys_per_block * stride;
  acc_t* dv_s = dk_s + keys_per_block * stride;
  acc_t* q_tile = dv_s + keys_per_block * stride;  // (kTile, stride), pre-scaled
  acc_t* do_tile = q_tile + kTile * stride;        // (kTile, stride)
  acc_t* lse_tile = do_tile + kTile * stride;      // (kTile,)
  acc_t* delta_tile = lse_tile + kTile;            // (kTile,)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // A warp per key row, lanes along it: no 64-bit division per element (its subroutine calls spilled on sm_90).
  for (int64_t f = warp; f < keys; f += kWarps) {
    const int64_t row = flow_key_row(d, t, t.first + f) * dh;
    for (int64_t i = lane; i < dh; i += 32) {
      k_s[f * stride + i] = static_cast<acc_t>(fk[row + i]);
      v_s[f * stride + i] = static_cast<acc_t>(fv[row + i]);
    }
  }
  zero_rows(keys, dh, dk_s);
  zero_rows(keys, dh, dv_s);
  for (int64_t start = 0; start < task_rows; start += kTile) {
    __syncthreads();
    load_query_rows(d, t, q, start, kTile, scale, q_tile);
    load_query_rows(d, t, grad, start, kTile, acc_t(1), do_tile);
    for (int64_t r = threadIdx.x; r < kTile; r += blockDim.x) {
      const bool valid = start + r < task_rows;
      lse_tile[r] = valid ? lse[query_row(d, t, start + r)] : acc_t(0);
      delta_tile[r] = valid ? delta[query_row(d, t, start + r)] : acc_t(0);
    }
    __syncthreads();
    for (int64_t f = warp; f < keys; f += kWarps) {
      acc_t p = acc_t(0), ds = acc_t(0);
      if (start + lane < task_rows) {
        acc_t score = acc_t(0), dp = acc_t(0);
        for (int64_t i = 0; i < dh; ++i) {
          score += q_tile[lane * stride + i] * k_s[f * stride + i];
          dp += do_tile[lane * stride + i] * v_s[f * stride + i];
        }
        p = exp(score - lse_tile[lane]);
        ds = p * (dp - delta_tile[lane]);
      }
      for (int jj = 0; jj < kTile; ++jj) {
        const acc_t pj = __shfl_sync(0xffffffffu, p, jj), dsj = __shfl_sync(0xffffffffu, ds, jj);
        for (int64_t i = lane; i < dh; i += 32) {
          dk_s[f * stride + i] += dsj * q_tile[jj * stride + i];
          dv_s[f * stride + i] += pj * do_tile[jj * stride + i];
        }
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int64_t f = warp; f < keys; f += kWarps) {
    const int64_t row = flow_key_row(d, t, t.first + f) * dh;
    for (int64_t i = lane; i < dh; i += 32) {
      dfk[row + i] = static_cast<scalar_t>(dk_s[f * stride + i]);
      dfv[row + i] = static_cast<scalar_t>(dv_s[f * stride + i]);
    }
  }
}

// How a kernel's items (query rows or flow keys of a task) are cut into blocks: the shared memory of a block is
// `fixed + per_item · n` elements for n items; n is the largest ≤ kMax… that fits this GPU's per-block limit.
struct BlockPlan {
  int64_t per_block;
  size_t shared_bytes;
  int blocks;
};

BlockPlan plan_blocks(const char* kernel, const char* item, int64_t tasks, int64_t items, int64_t max_per_block,
                      int64_t fixed, int64_t per_item, int64_t element_bytes, int64_t head_dim) {
  int device = 0, limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t fitting = (int64_t(limit) / element_bytes - fixed) / per_item;
  TORCH_CHECK(fitting >= 1, kernel, ": head_dim ", head_dim, " needs ", (fixed + per_item) * element_bytes,
              " bytes of shared memory per block with a single ", item, ", more than this GPU's ", limit,
              " (cudaDevAttrMaxSharedMemoryPerBlockOptin); use FLOWKIT_KERNELS=triton or reference");
  TORCH_CHECK(items <= INT_MAX, kernel, ": ", items, " ", item, "s per task exceed 32-bit indexing");
  const int64_t per_block = std::min({items, max_per_block, fitting});
  const int64_t blocks = tasks * ((items + per_block - 1) / per_block);
  TORCH_CHECK(blocks <= INT_MAX, kernel, ": ", blocks, " blocks exceed the grid limit");
  return {per_block, size_t((fixed + per_item * per_block) * element_bytes), int(blocks)};
}

// 1/√dh, computed on the host: on the device a double sqrt calls a slow-path subroutine, and ptxas spilled the dQ
// kernel's registers around that call.
template <typename acc_t>
acc_t softmax_scale(const Dims& d) {
  return static_cast<acc_t>(1.0 / std::sqrt(static_cast<double>(d.head_dim)));
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (int64_t(bytes) > kDefaultSharedBytes)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

std::tuple<at::Tensor, at::Tensor> flow_attention_cuda(const at::Tensor& q_in, const at::Tensor& fk_in,
                                                       const at::Tensor& fv_in, const at::Tensor& ck_in,
                                                       const at::Tensor& cv_in, const at::Tensor& lens_in) {
  const Dims d = check_flow_attention_inputs(q_in, fk_in, fv_in, ck_in, cv_in, lens_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({d.batch, d.steps, d.flow, d.heads},
                             q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  const int64_t tasks = d.batch * d.steps * d.kv_heads, rows = d.flow * d.group;
  if (tasks == 0 || rows == 0) return {out, lse};
  const int64_t stride = shared_stride(d.head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // q and the accumulator per row, m and l per row; the K and V tiles
    const BlockPlan plan = plan_blocks("flow_attention (CUDA)", "query row", tasks, rows, kMaxRowsPerBlock,
                                       2 * kTile * stride, 2 * stride + 2, sizeof(acc_t), d.head_dim);
    allow_shared(flow_attention_fwd_kernel<scalar_t>, plan.shared_bytes);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    flow_attention_fwd_kernel<scalar_t><<<plan.blocks, kThreads, plan.shared_bytes, stream>>>(
        q.data_ptr<scalar_t>(), fk.data_ptr<scalar_t>(), fv.data_ptr<scalar_t>(), ck.data_ptr<scalar_t>(),
        cv.data_ptr<scalar_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(), d,
        plan.per_block, softmax_scale<acc_t>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flow_attention_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& fk_in, const at::Tensor& fv_in,
    const at::Tensor& ck_in, const at::Tensor& cv_in, const at::Tensor& lens_in, const at::Tensor& out_in,
    const at::Tensor& lse_in) {
  const Dims d = check_flow_attention_inputs(q_in, fk_in, fv_in, ck_in, cv_in, lens_in);
  check_flow_attention_backward_inputs(q_in, grad_in, out_in, lse_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  const at::Tensor grad = grad_in.contiguous().to(q.scalar_type());
  const at::Tensor out = out_in.contiguous(), lse = lse_in.contiguous();
  at::Tensor grad_q = at::empty_like(q), grad_fk = at::empty_like(fk), grad_fv = at::empty_like(fv);
  const int64_t tasks = d.batch * d.steps * d.kv_heads, rows = d.flow * d.group;
  if (tasks == 0 || rows == 0) return {grad_q, grad_fk.zero_(), grad_fv.zero_()};  // no query sees a flow key
  at::Tensor delta = at::empty_like(lse);  // rowsum(dO ⊙ O), written by the dQ kernel, read by the dK/dV kernel
  const int64_t stride = shared_stride(d.head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // q, dO and dQ per row, delta per row; the K and V tiles
    const BlockPlan rows_plan = plan_blocks("flow_attention_backward (CUDA, dQ)", "query row", tasks, rows,
                                            kMaxRowsPerBlock, 2 * kTile * stride, 3 * stride + 1, sizeof(acc_t),
                                            d.head_dim);
    allow_shared(flow_attention_dq_kernel<scalar_t>, rows_plan.shared_bytes);
    flow_attention_dq_kernel<scalar_t><<<rows_plan.blocks, kThreads, rows_plan.shared_bytes, stream>>>(
        grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), fk.data_ptr<scalar_t>(), fv.data_ptr<scalar_t>(),
        ck.data_ptr<scalar_t>(), cv.data_ptr<scalar_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
        lse.data_ptr<acc_t>(), delta.data_ptr<acc_t>(), grad_q.data_ptr<scalar_t>(), d, rows_plan.per_block,
        softmax_scale<acc_t>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // K, V, dK and dV per flow key; the q and dO tiles with their lse and delta
    const BlockPlan keys_plan = plan_blocks("flow_attention_backward (CUDA, dK/dV)", "flow key", tasks, d.flow,
                                            kMaxKeysPerBlock, 2 * kTile * stride + 2 * kTile, 4 * stride,
                                            sizeof(acc_t), d.head_dim);
    allow_shared(flow_attention_dkv_kernel<scalar_t>, keys_plan.shared_bytes);
    flow_attention_dkv_kernel<scalar_t><<<keys_plan.blocks, kThreads, keys_plan.shared_bytes, stream>>>(
        grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), fk.data_ptr<scalar_t>(), fv.data_ptr<scalar_t>(),
        lens.data_ptr<int64_t>(), lse.data_ptr<acc_t>(), delta.data_ptr<acc_t>(), grad_fk.data_ptr<scalar_t>(),
        grad_fv.data_ptr<scalar_t>(), d, keys_plan.per_block, softmax_scale<acc_t>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_q, grad_fk, grad_fv};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CUDA, m) {
  m.impl("flow_attention", &flow_attention_cuda);
  m.impl("flow_attention_backward", &flow_attention_backward_cuda);
}

}  // namespace flowkit
