// The shapes of flowkit::flow_attention[_backward]'s inputs, checked in one place for the CPU and CUDA kernels
// (they index raw pointers with these sizes, so a mismatch must stop here, not read out of bounds).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>

namespace flowkit {

struct FlowAttentionDims {
  int64_t batch, steps, flow, heads, kv_heads, context, head_dim, group;
};

inline FlowAttentionDims check_flow_attention_inputs(const at::Tensor& q, const at::Tensor& flow_k,
                                                     const at::Tensor& flow_v, const at::Tensor& context_k,
                                                     const at::Tensor& context_v, const at::Tensor& prefix_lengths) {
  TORCH_CHECK(q.dim() == 5, "q must be (B, S, F, H, dh)");
  TORCH_CHECK(flow_k.dim() == 5 && flow_k.sizes() == flow_v.sizes(), "flow_k / flow_v must be (B, S, F, Hkv, dh)");
  const FlowAttentionDims d{q.size(0), q.size(1), q.size(2), q.size(3), flow_k.size(3), context_k.size(2), q.size(4),
                            q.size(3) / std::max<int64_t>(flow_k.size(3), 1)};
  TORCH_CHECK(flow_k.size(0) == d.batch && flow_k.size(1) == d.steps && flow_k.size(2) == d.flow &&
                  flow_k.size(4) == d.head_dim,
              "flow_k does not match q");
  TORCH_CHECK(d.kv_heads > 0 && d.heads % d.kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(context_k.dim() == 4 && context_k.sizes() == context_v.sizes() && context_k.size(0) == d.batch &&
                  context_k.size(1) == d.kv_heads && context_k.size(3) == d.head_dim,
              "context_k / context_v must be (B, Hkv, N, dh)");
  TORCH_CHECK(prefix_lengths.dim() == 2 && prefix_lengths.size(0) == d.batch && prefix_lengths.size(1) == d.steps &&
                  prefix_lengths.scalar_type() == at::kLong,
              "prefix_lengths must be int64 (B, S)");
  TORCH_CHECK(q.scalar_type() == flow_k.scalar_type() && q.scalar_type() == flow_v.scalar_type() &&
                  q.scalar_type() == context_k.scalar_type() && q.scalar_type() == context_v.scalar_type(),
              "q, flow and context tensors must share a dtype");
  for (const at::Tensor* t : {&flow_k, &flow_v, &context_k, &context_v, &prefix_lengths})
    TORCH_CHECK(t->device() == q.device(), "flow_attention: all inputs must be on the device of q (", q.device(), ")");
  return d;
}

// The backward's extra inputs: the output gradient and the forward's output match q, its log-sum-exp q without dh.
inline void check_flow_attention_backward_inputs(const at::Tensor& q, const at::Tensor& grad_out, const at::Tensor& out,
                                                 const at::Tensor& lse) {
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), "grad_out and out must have the shape of q");
  TORCH_CHECK(lse.sizes() == q.sizes().slice(0, 4), "lse must be (B, S, F, H)");
  for (const at::Tensor* t : {&grad_out, &out, &lse})
    TORCH_CHECK(t->device() == q.device(), "flow_attention_backward: all inputs must be on the device of q (",
                q.device(), ")");
}

}  // namespace flowkit
