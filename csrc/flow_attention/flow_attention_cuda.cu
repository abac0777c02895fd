// CUDA kernels for flowkit::flow_attention[_backward]; same contract as flow_attention_cpu.cpp.
// One block per (b, s, kv head) holds its R = F·G query rows in shared memory; the visible keys (context
// [0, len) then the F flow keys) stream through shared tiles of 32, one key per lane, one query row per warp,
// with an online softmax. The backward accumulates the flow keys' gradients in shared memory (no global atomics).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "../cuda_utils.cuh"

namespace flowkit {
namespace {

constexpr int kTile = 32;
constexpr int kWarps = 4;

struct Dims {
  int64_t batch, steps, flow, heads, kv_heads, context, head_dim, group;
};

// Key / value row j of task (b, s, kvh): context row j < len, else flow token j − len.
template <typename scalar_t>
__device__ __forceinline__ int64_t key_offset(const Dims& d, int64_t b, int64_t s, int64_t kvh, int64_t len, int64_t j,
                                              bool* is_flow) {
  *is_flow = j >= len;
  if (j < len) return ((b * d.kv_heads + kvh) * d.context + j) * d.head_dim;
  return (((b * d.steps + s) * d.flow + (j - len)) * d.kv_heads + kvh) * d.head_dim;
}

// Loads keys [start, start + kTile) of the task into shared tiles (zeros past the end).
template <typename scalar_t, typename acc_t>
__device__ void load_tile(const Dims& d, const scalar_t* ck, const scalar_t* cv, const scalar_t* fk, const scalar_t* fv,
                          int64_t b, int64_t s, int64_t kvh, int64_t len, int64_t start, acc_t* k_tile, acc_t* v_tile) {
  const int64_t keys = len + d.flow;
  for (int64_t e = threadIdx.x; e < kTile * d.head_dim; e += blockDim.x) {
    const int64_t jj = e / d.head_dim, i = e % d.head_dim, j = start + jj;
    acc_t k = acc_t(0), v = acc_t(0);
    if (j < keys) {
      bool is_flow;
      const int64_t off = key_offset<scalar_t>(d, b, s, kvh, len, j, &is_flow) + i;
      k = static_cast<acc_t>(is_flow ? fk[off] : ck[off]);
      v = static_cast<acc_t>(is_flow ? fv[off] : cv[off]);
    }
    k_tile[e] = k;
    v_tile[e] = v;
  }
}

template <typename scalar_t>
__global__ void flow_attention_fwd_kernel(const scalar_t* q, const scalar_t* fk, const scalar_t* fv, const scalar_t* ck,
                                          const scalar_t* cv, const int64_t* lens, scalar_t* out,
                                          at::opmath_type<scalar_t>* lse, Dims d) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* smem = reinterpret_cast<acc_t*>(smem_raw);
  const int64_t rows = d.flow * d.group, dh = d.head_dim;
  acc_t* q_s = smem;                  // (rows, dh), pre-scaled
  acc_t* acc_s = q_s + rows * dh;     // (rows, dh)
  acc_t* k_tile = acc_s + rows * dh;  // (kTile, dh)
  acc_t* v_tile = k_tile + kTile * dh;
  acc_t* m_s = v_tile + kTile * dh;   // (rows,)
  acc_t* l_s = m_s + rows;

  const int64_t task = blockIdx.x;
  const int64_t kvh = task % d.kv_heads, s = (task / d.kv_heads) % d.steps, b = task / (d.kv_heads * d.steps);
  const int64_t len = min(max(lens[b * d.steps + s], int64_t(0)), d.context);
  const acc_t scale = acc_t(1) / sqrt(static_cast<acc_t>(dh));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto q_row = [&](int64_t r) { return ((b * d.steps + s) * d.flow + r / d.group) * d.heads + kvh * d.group + r % d.group; };

  for (int64_t e = threadIdx.x; e < rows * dh; e += blockDim.x) {
    q_s[e] = static_cast<acc_t>(q[q_row(e / dh) * dh + e % dh]) * scale;
    acc_s[e] = acc_t(0);
  }
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    m_s[r] = -INFINITY;
    l_s[r] = acc_t(0);
  }
  const int64_t keys = len + d.flow;
  for (int64_t start = 0; start < keys; start += kTile) {
    __syncthreads();
    load_tile(d, ck, cv, fk, fv, b, s, kvh, len, start, k_tile, v_tile);
    __syncthreads();
    for (int64_t r = warp; r < rows; r += kWarps) {
      const acc_t* qr = q_s + r * dh;
      acc_t score = -INFINITY;
      if (start + lane < keys) {
        score = acc_t(0);
        for (int64_t i = 0; i < dh; ++i) score += qr[i] * k_tile[lane * dh + i];
      }
      const acc_t m_old = m_s[r];
      const acc_t m_new = max(m_old, warp_max(score));
      const acc_t p = start + lane < keys ? exp(score - m_new) : acc_t(0);
      const acc_t alpha = exp(m_old - m_new);
      const acc_t p_sum = warp_sum(p);
      acc_t* ar = acc_s + r * dh;
      for (int64_t i = lane; i < dh; i += 32) ar[i] *= alpha;
      for (int jj = 0; jj < kTile; ++jj) {
        const acc_t pj = __shfl_sync(0xffffffffu, p, jj);
        for (int64_t i = lane; i < dh; i += 32) ar[i] += pj * v_tile[jj * dh + i];
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
  for (int64_t e = threadIdx.x; e < rows * dh; e += blockDim.x) {
    const int64_t r = e / dh;
    out[q_row(r) * dh + e % dh] = static_cast<scalar_t>(acc_s[e] / l_s[r]);
  }
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) lse[q_row(r)] = m_s[r] + log(l_s[r]);
}

template <typename scalar_t>
__global__ void flow_attention_bwd_kernel(const scalar_t* grad, const scalar_t* q, const scalar_t* fk,
                                          const scalar_t* fv, const scalar_t* ck, const scalar_t* cv,
                                          const int64_t* lens, const scalar_t* out,
                                          const at::opmath_type<scalar_t>* lse, scalar_t* dq, scalar_t* dfk,
                                          scalar_t* dfv, Dims d) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char smem_raw[];
  acc_t* smem = reinterpret_cast<acc_t*>(smem_raw);
  const int64_t rows = d.flow * d.group, dh = d.head_dim;
  acc_t* q_s = smem;                    // (rows, dh), pre-scaled
  acc_t* do_s = q_s + rows * dh;        // (rows, dh)
  acc_t* dq_s = do_s + rows * dh;       // (rows, dh)
  acc_t* k_tile = dq_s + rows * dh;     // (kTile, dh)
  acc_t* v_tile = k_tile + kTile * dh;
  acc_t* dk_s = v_tile + kTile * dh;    // (F, dh)
  acc_t* dv_s = dk_s + d.flow * dh;     // (F, dh)
  acc_t* delta_s = dv_s + d.flow * dh;  // (rows,)

  const int64_t task = blockIdx.x;
  const int64_t kvh = task % d.kv_heads, s = (task / d.kv_heads) % d.steps, b = task / (d.kv_heads * d.steps);
  const int64_t len = min(max(lens[b * d.steps + s], int64_t(0)), d.context);
  const acc_t scale = acc_t(1) / sqrt(static_cast<acc_t>(dh));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto q_row = [&](int64_t r) { return ((b * d.steps + s) * d.flow + r / d.group) * d.heads + kvh * d.group + r % d.group; };

  for (int64_t e = threadIdx.x; e < rows * dh; e += blockDim.x) {
    const int64_t off = q_row(e / dh) * dh + e % dh;
    q_s[e] = static_cast<acc_t>(q[off]) * scale;
    do_s[e] = static_cast<acc_t>(grad[off]);
    dq_s[e] = acc_t(0);
  }
  for (int64_t e = threadIdx.x; e < d.flow * dh; e += blockDim.x) {
    dk_s[e] = acc_t(0);
    dv_s[e] = acc_t(0);
  }
  for (int64_t r = warp; r < rows; r += kWarps) {  // delta = rowsum(dO ⊙ O)
    acc_t partial = acc_t(0);
    for (int64_t i = lane; i < dh; i += 32) partial += do_s[r * dh + i] * static_cast<acc_t>(out[q_row(r) * dh + i]);
    partial = warp_sum(partial);
    if (lane == 0) delta_s[r] = partial;
  }
  const int64_t keys = len + d.flow;
  for (int64_t start = 0; start < keys; start += kTile) {
    __syncthreads();
    load_tile(d, ck, cv, fk, fv, b, s, kvh, len, start, k_tile, v_tile);
    __syncthreads();
    for (int64_t r = warp; r < rows; r += kWarps) {
      const int64_t j = start + lane;
      acc_t p = acc_t(0), ds = acc_t(0);
      if (j < keys) {
        acc_t score = acc_t(0), dp = acc_t(0);
        for (int64_t i = 0; i < dh; ++i) {
          score += q_s[r * dh + i] * k_tile[lane * dh + i];
          dp += do_s[r * dh + i] * v_tile[lane * dh + i];
        }
        p = exp(score - lse[q_row(r)]);
        ds = p * (dp - delta_s[r]);
        if (j >= len) {  // flow key: gradient of its K (w.r.t. unscaled scores: ds·q_scaled) and V
          for (int64_t i = 0; i < dh; ++i) {
            atomicAdd(dk_s + (j - len) * dh + i, ds * q_s[r * dh + i]);
            atomicAdd(dv_s + (j - len) * dh + i, p * do_s[r * dh + i]);
          }
        }
      }
      for (int jj = 0; jj < kTile; ++jj) {
        const acc_t dsj = __shfl_sync(0xffffffffu, ds, jj);
        for (int64_t i = lane; i < dh; i += 32) dq_s[r * dh + i] += dsj * k_tile[jj * dh + i];
      }
      __syncwarp();
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < rows * dh; e += blockDim.x)
    dq[q_row(e / dh) * dh + e % dh] = static_cast<scalar_t>(dq_s[e] * scale);
  for (int64_t e = threadIdx.x; e < d.flow * dh; e += blockDim.x) {
    const int64_t off = (((b * d.steps + s) * d.flow + e / dh) * d.kv_heads + kvh) * dh + e % dh;
    dfk[off] = static_cast<scalar_t>(dk_s[e]);
    dfv[off] = static_cast<scalar_t>(dv_s[e]);
  }
}

Dims dims_of(const at::Tensor& q, const at::Tensor& flow_k, const at::Tensor& context_k, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 5 && flow_k.dim() == 5 && context_k.dim() == 4, "expected q (B,S,F,H,dh), flow_k (B,S,F,Hkv,dh), context_k (B,Hkv,N,dh)");
  TORCH_CHECK(q.size(3) % flow_k.size(3) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 2, "prefix_lengths must be int64 (B, S)");
  return Dims{q.size(0), q.size(1), q.size(2), q.size(3), flow_k.size(3), context_k.size(2), q.size(4),
              q.size(3) / flow_k.size(3)};
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

std::tuple<at::Tensor, at::Tensor> flow_attention_cuda(const at::Tensor& q_in, const at::Tensor& fk_in,
                                                       const at::Tensor& fv_in, const at::Tensor& ck_in,
                                                       const at::Tensor& cv_in, const at::Tensor& lens_in) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  const Dims d = dims_of(q, fk, ck, lens);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({d.batch, d.steps, d.flow, d.heads},
                             q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  const int64_t tasks = d.batch * d.steps * d.kv_heads;
  if (tasks == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t rows = d.flow * d.group;
    const size_t bytes = sizeof(acc_t) * (2 * rows * d.head_dim + 2 * kTile * d.head_dim + 2 * rows);
    allow_shared(flow_attention_fwd_kernel<scalar_t>, bytes);
    flow_attention_fwd_kernel<scalar_t><<<tasks, kWarps * 32, bytes, c10::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), fk.data_ptr<scalar_t>(), fv.data_ptr<scalar_t>(), ck.data_ptr<scalar_t>(),
        cv.data_ptr<scalar_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(), d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flow_attention_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& fk_in, const at::Tensor& fv_in,
    const at::Tensor& ck_in, const at::Tensor& cv_in, const at::Tensor& lens_in, const at::Tensor& out_in,
    const at::Tensor& lse_in) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), fk = fk_in.contiguous(), fv = fv_in.contiguous();
  const at::Tensor ck = ck_in.contiguous(), cv = cv_in.contiguous(), lens = lens_in.contiguous();
  const at::Tensor grad = grad_in.contiguous().to(q.scalar_type()), out = out_in.contiguous(), lse = lse_in.contiguous();
  const Dims d = dims_of(q, fk, ck, lens);
  at::Tensor grad_q = at::empty_like(q), grad_fk = at::empty_like(fk), grad_fv = at::empty_like(fv);
  const int64_t tasks = d.batch * d.steps * d.kv_heads;
  if (tasks == 0) return {grad_q, grad_fk, grad_fv};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flow_attention_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t rows = d.flow * d.group;
    const size_t bytes =
        sizeof(acc_t) * (3 * rows * d.head_dim + 2 * kTile * d.head_dim + 2 * d.flow * d.head_dim + rows);
    allow_shared(flow_attention_bwd_kernel<scalar_t>, bytes);
    flow_attention_bwd_kernel<scalar_t><<<tasks, kWarps * 32, bytes, c10::cuda::getCurrentCUDAStream()>>>(
        grad.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), fk.data_ptr<scalar_t>(), fv.data_ptr<scalar_t>(),
        ck.data_ptr<scalar_t>(), cv.data_ptr<scalar_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
        lse.data_ptr<acc_t>(), grad_q.data_ptr<scalar_t>(), grad_fk.data_ptr<scalar_t>(), grad_fv.data_ptr<scalar_t>(), d);
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
