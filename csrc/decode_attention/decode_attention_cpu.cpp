// CPU kernel for one decoding step's attention (flowkit::decode_attention): each row has one new query per head,
// against its cached keys and values. For each (row, KV head) the group's queries score the keys, take a softmax
// and sum the values, with the scores in a per-thread buffer: a few µs per pair, where PyTorch's flash kernel for
// CPU sets up blocks and buffers sized for long queries (~1.2 µs per pair and head at 30 keys, the bundled policy).
// Parallel over (row, KV head) with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "../fast_exp.h"
#include "../simd_clones.h"

namespace flowkit {
namespace {

// One (row, KV head): its group's queries q[g·q_step …] over keys k[l·k_step …] and values v[l·v_step …], keys
// whose mask entry is false left out; out[g·dim …] takes the result. scores holds `length` floats. kDim > 0 fixes
// the head dimension at compile time, so a query's output stays in registers across the keys (0: any `dim`).
template <int64_t kDim>
inline __attribute__((always_inline)) void attend(const float* q, int64_t q_step, const float* k, int64_t k_step,
                                                  const float* v, int64_t v_step, const bool* mask, int64_t length,
                                                  int64_t group, int64_t dim, float scale, float* scores, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t n = kDim > 0 ? kDim : dim;
  for (int64_t g = 0; g < group; ++g, q += q_step, out += n) {
    float top = kNegInf;
    for (int64_t l = 0; l < length; ++l) {
      float dot = 0.0f;
      const float* key = k + l * k_step;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < n; ++d) dot += q[d] * key[d];
      scores[l] = mask && !mask[l] ? kNegInf : scale * dot;
      top = scores[l] > top ? scores[l] : top;
    }
    if (top == kNegInf) {  // every key masked: zeros
      for (int64_t d = 0; d < n; ++d) out[d] = 0.0f;
      continue;
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t l = 0; l < length; ++l) {
      scores[l] = exp_nonpositive(scores[l] - top);
      total += scores[l];
    }
    float acc[kDim > 0 ? kDim : 1];
    float* sum = kDim > 0 ? acc : out;
    for (int64_t d = 0; d < n; ++d) sum[d] = 0.0f;
    for (int64_t l = 0; l < length; ++l) {
      const float weight = scores[l];
      const float* value = v + l * v_step;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) sum[d] += weight * value[d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < n; ++d) out[d] = sum[d] * inverse;
  }
}

#define FLOWKIT_ATTEND(NAME, DIM)                                                                                    \
  FLOWKIT_SIMD_CLONES void NAME(const float* q, int64_t q_step, const float* k, int64_t k_step, const float* v,      \
                                int64_t v_step, const bool* mask, int64_t length, int64_t group, int64_t dim,        \
                                float scale, float* scores, float* out) {                                            \
    attend<DIM>(q, q_step, k, k_step, v, v_step, mask, length, group, dim, scale, scores, out);                      \
  }
FLOWKIT_ATTEND(attend_any, 0)
FLOWKIT_ATTEND(attend_64, 64)
FLOWKIT_ATTEND(attend_128, 128)
FLOWKIT_ATTEND(attend_32, 32)
#undef FLOWKIT_ATTEND

void check_inputs(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4,
              "query (B, Hkv, G, D), keys and values (B, Hkv, L, D)");
  for (const at::Tensor* t : {&query, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(3) == 1, "float32 tensors with a dense last dimension");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == query.size(0) && keys.size(1) == query.size(1) &&
                  keys.size(3) == query.size(3),
              "keys and values must be (B, Hkv, L, D) of the query's B, Hkv and D");
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == keys.size(0) &&
                    mask->size(1) == keys.size(2),
                "mask must be bool (B, L)");
}

at::Tensor decode_attention_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                const std::optional<at::Tensor>& mask_in, double scale) {
  check_inputs(query, keys, values, mask_in);
  const int64_t rows = query.size(0), kv_heads = query.size(1), group = query.size(2), dim = query.size(3);
  const int64_t length = keys.size(2);
  const at::Tensor mask = mask_in.has_value() && mask_in->defined() ? mask_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({rows, kv_heads, group, dim}, query.options());
  const float* q_ptr = query.data_ptr<float>();
  const float *k_ptr = keys.data_ptr<float>(), *v_ptr = values.data_ptr<float>();
  const bool* m_ptr = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  float* o_ptr = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const auto attend_pair = dim == 32 ? attend_32 : dim == 64 ? attend_64 : dim == 128 ? attend_128 : attend_any;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(length);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, h = pair % kv_heads;
      attend_pair(q_ptr + b * query.stride(0) + h * query.stride(1), query.stride(2),
             k_ptr + b * keys.stride(0) + h * keys.stride(1), keys.stride(2),
             v_ptr + b * values.stride(0) + h * values.stride(1), values.stride(2), m_ptr ? m_ptr + b * length : nullptr,
             length, group, dim, s, scores.data(), o_ptr + pair * group * dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }

}  // namespace flowkit
