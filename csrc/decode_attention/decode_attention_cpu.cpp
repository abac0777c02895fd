// CPU kernel for one decoding step's attention (flowkit::decode_attention): each row has one new query per head,
// against its cached keys and values. For each (row, KV head) the group's queries score the keys, take a softmax
// and sum the values, with the scores in a per-thread buffer, where PyTorch's flash kernel for CPU sets up blocks
// and buffers sized for long queries. At head dimensions 32/64/128 the scores come 16 keys at a time, their dot
// products' lanes summed as a tree of shuffles (one key at a time, the lanes' sequential sum took half the kernel's
// time). Parallel over (row, KV head) with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "../fast_exp.h"
#include "../simd_clones.h"
#include "../vector16.h"

namespace flowkit {
namespace {

// One (row, KV head): its group's queries q[g·q_step …] over keys k[l·k_step …] and values v[l·v_step …], keys
// whose mask entry is false left out; out[g·dim …] takes the result. scores holds `length` floats rounded up to 16.
// kDim > 0 (a multiple of 16) fixes the head dimension at compile time: the scores come 16 keys at a time and a
// query's output stays in registers across the keys (0: any `dim`, one key at a time).
template <int64_t kDim>
inline __attribute__((always_inline)) void attend(const float* q, int64_t q_step, const float* k, int64_t k_step,
                                                  const float* v, int64_t v_step, const bool* mask, int64_t length,
                                                  int64_t group, int64_t dim, float scale, float* scores, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t n = kDim > 0 ? kDim : dim;
  for (int64_t g = 0; g < group; ++g, q += q_step, out += n) {
    float top = kNegInf;
    if constexpr (kDim > 0) {
      Floats16 query[kDim / 16];
      for (int64_t c = 0; c < kDim / 16; ++c) query[c] = load16(q + 16 * c);
      const Floats16 none = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf,
                             kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
      const Lanes16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      Floats16 tops = none;
      for (int64_t l = 0; l < length; l += 16) {
        Lanes16 kept = lanes < static_cast<int32_t>(length - l);  // keys past the end, or masked, score −∞
        if (mask) {
          Bytes16 entries = {};
          if (length - l >= 16)
            __builtin_memcpy(&entries, mask + l, 16);
          else
            for (int64_t lane = 0; lane < length - l; ++lane) entries[lane] = mask[l + lane];
          kept &= __builtin_convertvector(entries, Lanes16) != 0;
        }
        Floats16 block = scale * block_scores<kDim>(query, k + l * k_step, k_step, length - l);
        block = kept ? block : none;
        tops = tops > block ? tops : block;
        __builtin_memcpy(scores + l, &block, sizeof(block));
      }
      top = reduce(tops, [](Floats16 a, Floats16 b) { return a > b ? a : b; });
    } else {
      for (int64_t l = 0; l < length; ++l) {
        float dot = 0.0f;
        const float* key = k + l * k_step;
        for (int64_t d = 0; d < n; ++d) dot += q[d] * key[d];
        scores[l] = mask && !mask[l] ? kNegInf : scale * dot;
        top = scores[l] > top ? scores[l] : top;
      }
    }
    if (top == kNegInf) {  // every key masked: zeros
      for (int64_t d = 0; d < n; ++d) out[d] = 0.0f;
      continue;
    }
    float total = 0.0f;
    if constexpr (kDim > 0) {  // whole blocks: the lanes past the end hold −∞, whose exponential is 0
      Floats16 totals = {};
      for (int64_t l = 0; l < length; l += 16) {
        Floats16 block;
#pragma omp simd
        for (int64_t lane = 0; lane < 16; ++lane) block[lane] = exp_nonpositive(scores[l + lane] - top);
        totals += block;
        __builtin_memcpy(scores + l, &block, sizeof(block));
      }
      total = reduce(totals, [](Floats16 a, Floats16 b) { return a + b; });
    } else {
      for (int64_t l = 0; l < length; ++l) {
        scores[l] = exp_nonpositive(scores[l] - top);
        total += scores[l];
      }
    }
    const float inverse = 1.0f / total;
    if constexpr (kDim > 0) {
      Floats16 sum[kDim / 16];
      weighted_rows<kDim>(scores, v, v_step, length, sum);
      for (int64_t c = 0; c < kDim / 16; ++c) {
        const Floats16 result = sum[c] * inverse;
        __builtin_memcpy(out + 16 * c, &result, sizeof(result));
      }
    } else {
      for (int64_t d = 0; d < n; ++d) out[d] = 0.0f;
      for (int64_t l = 0; l < length; ++l) {
        const float* value = v + l * v_step;
        for (int64_t d = 0; d < n; ++d) out[d] += scores[l] * value[d];
      }
      for (int64_t d = 0; d < n; ++d) out[d] *= inverse;
    }
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
    std::vector<float> scores((length + 15) / 16 * 16);  // whole blocks of 16 scores
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
