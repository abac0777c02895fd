// flowkit._C: the Python module that loads the native ops, and the op schemas (torch.ops.flowkit.*).
// Kernels register per device in csrc/<op>/<op>_{cpu.cpp,cuda.cu}; Python adds fake tensors and autograd
// (flowkit/kernels/native/).
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "flowkit native ops (torch.ops.flowkit)", -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(flowkit, m) {
  // RLFR prologue: x_t = t·x1 + (1−t)·ε for every (percentile, timestep, token) row; ε regenerated from seed.
  // ε is indexed by the global token (token_offset + n), so a token chunk sees the noise of the whole batch.
  m.def("interpolate_latents(Tensor x1, Tensor timesteps, int seed, int token_offset) -> Tensor");
  // RLFR epilogue: score[n] = mask[n] · mean_{p,t} w_t · mean_d (v − (x1 − ε))² (eq. 7 with w_t = t/(1−t)).
  m.def(
      "velocity_deviation(Tensor v, Tensor x1, Tensor timesteps, Tensor weights, int seed, int token_offset, "
      "Tensor mask) -> Tensor");
  m.def(
      "velocity_deviation_backward(Tensor grad_score, Tensor v, Tensor x1, Tensor timesteps, Tensor weights, int seed, "
      "int token_offset, Tensor mask) -> Tensor");
  // Flow-token attention core: RoPE'd flow queries over context keys [0, prefix_len) plus the flow keys (GQA);
  // returns the output (B, S, F, H, dh) and the float32 log-sum-exp (B, S, F, H) for the backward.
  m.def(
      "flow_attention(Tensor q, Tensor flow_k, Tensor flow_v, Tensor context_k, Tensor context_v, "
      "Tensor prefix_lengths) -> (Tensor, Tensor)");
  m.def(
      "flow_attention_backward(Tensor grad_out, Tensor q, Tensor flow_k, Tensor flow_v, Tensor context_k, "
      "Tensor context_v, Tensor prefix_lengths, Tensor out, Tensor lse) -> (Tensor, Tensor, Tensor)");
  // LM-head softmax over the vocabulary: log p(target), the entropy and the log-normaliser of z/T per row of raw
  // float32 logits z (N, V); the backward overwrites z with ∂(Σ g_p·log p + g_H·H)/∂z.
  m.def("logprob_entropy(Tensor logits, Tensor targets, float temperature) -> (Tensor, Tensor, Tensor)");
  // One decoding step's attention: the group of queries (B, Hkv, G, D) of each row and KV head over its cached keys
  // and values (B, Hkv, L, D; any strides but the last), keys where the bool mask (B, L) is false left out.
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
  // Llama-family MLP gate: silu(gate)·up, and both gradients from the output's.
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // RMSNorm over the last dimension: w·x/rms(x) and each row's 1/rms; the backward gives x's and w's gradients.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, Tensor inverse_rms) -> (Tensor, Tensor)");
  // Rotary position embedding of each head of each row: x (N, H, D) · cos (N, D) + rotate_half(x) · sin (N, D).
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "logprob_entropy_backward_(Tensor(a!) logits, Tensor targets, Tensor log_normalizer, Tensor entropy, "
      "Tensor grad_logprob, Tensor? grad_entropy, float temperature) -> ()");
}
