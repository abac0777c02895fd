// CPU kernels for masked attention over short sequences with grouped KV heads (flowkit::short_attention[_backward]):
// a padded training forward's attention, each query row against at most a few hundred keys. PyTorch's flash kernel
// for CPU tiles queries and keys into blocks and buffers sized for long sequences; at ~30 queries and ~45 keys per
// row and head its setup outweighs the arithmetic. Here each (row, KV head) pair is one task: for each query its
// scores against every key (16 keys at a time, vector16.h), the softmax and the weighted values, the group's query
// heads reading the pair's keys and values while they are in cache. The backward recomputes the probabilities from
// the saved log-normalisers and accumulates the pair's key and value gradients in a buffer of its own.
// Head dimensions 32, 64 and 128. Parallel over (row, KV head) with at::parallel_for (OpenMP).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "../fast_exp.h"
#include "../simd_clones.h"
#include "../vector16.h"

namespace flowkit {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Strided views of the inputs: element (b, h, i, d) of a 4-D tensor at b·s0 + h·s1 + i·s2 + d.
struct View {
  const float* data;
  int64_t s0, s1, s2;
  const float* at(int64_t b, int64_t h, int64_t i) const { return data + b * s0 + h * s1 + i * s2; }
};

struct Shapes {
  int64_t query_heads, kv_heads, queries, keys;
};

// The mask (B, 1, Q, K), any strides: true where a query attends a key.
struct MaskView {
  const bool* data;
  int64_t s0, s2, s3;
  // query i of row b's entries as bytes, 1 where key j is attended
  void row(int64_t b, int64_t i, int64_t keys, int8_t* keep) const {
    const bool* entries = data + b * s0 + i * s2;
    for (int64_t j = 0; j < keys; ++j) keep[j] = entries[j * s3];
  }
};

// scale · q · key j for every key, −∞ where keep[j] is 0 (keep is zero past the keys, to whole blocks of 16);
// returns the max.
template <int64_t kDim>
inline __attribute__((always_inline)) float scores_of(const float* q, const View& k, int64_t b, int64_t h,
                                                      int64_t keys, const int8_t* keep, float scale, float* scores) {
  Floats16 query[kDim / 16];
  for (int64_t c = 0; c < kDim / 16; ++c) query[c] = load16(q + 16 * c);
  const Floats16 none = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf,
                         kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  Floats16 tops = none;
  for (int64_t j = 0; j < keys; j += 16) {
    Bytes16 entries;
    __builtin_memcpy(&entries, keep + j, sizeof(entries));
    const Lanes16 kept = __builtin_convertvector(entries, Lanes16) != 0;
    Floats16 block = scale * block_scores<kDim>(query, k.at(b, h, j), k.s2, keys - j);
    block = kept ? block : none;
    tops = tops > block ? tops : block;
    __builtin_memcpy(scores + j, &block, sizeof(block));
  }
  return reduce(tops, [](Floats16 a, Floats16 c) { return a > c ? a : c; });
}

// Forward of one (row b, KV head) pair: out (B, Q, H, D) and lse (B, H, Q) for its group's query heads.
template <int64_t kDim>
inline __attribute__((always_inline)) void forward_pair(const View& q, const View& k, const View& v,
                                      const MaskView& mask, const Shapes& n, int64_t b,
                                      int64_t kv_head, float scale, float* scores, int8_t* keep, float* out,
                                      float* lse) {
  const int64_t group = n.query_heads / n.kv_heads;
  for (int64_t i = 0; i < n.queries; ++i) {
    mask.row(b, i, n.keys, keep);
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      float* o = out + ((b * n.queries + i) * n.query_heads + h) * kDim;
      float* row_lse = lse + (b * n.query_heads + h) * n.queries + i;
      const float top = scores_of<kDim>(q.at(b, h, i), k, b, kv_head, n.keys, keep, scale, scores);
      if (top == kNegInf) {  // every key masked: zeros, and no gradient
        for (int64_t d = 0; d < kDim; ++d) o[d] = 0.0f;
        *row_lse = std::numeric_limits<float>::infinity();
        continue;
      }
      Floats16 totals = {};
      for (int64_t j = 0; j < n.keys; j += 16) {
        Floats16 block;
#pragma omp simd
        for (int64_t lane = 0; lane < 16; ++lane) block[lane] = exp_nonpositive(scores[j + lane] - top);
        totals += block;
        __builtin_memcpy(scores + j, &block, sizeof(block));
      }
      const float total = reduce(totals, [](Floats16 a, Floats16 c) { return a + c; });
      Floats16 sum[kDim / 16];
      weighted_rows<kDim>(scores, v.at(b, kv_head, 0), v.s2, n.keys, sum);
      const float inverse = 1.0f / total;
      for (int64_t c = 0; c < kDim / 16; ++c) {
        const Floats16 result = sum[c] * inverse;
        __builtin_memcpy(o + 16 * c, &result, sizeof(result));
      }
      *row_lse = top + std::log(total);
    }
  }
}

// Backward of one (row b, KV head) pair: dq (B, H, Q, D) of its group's heads, and its keys' and values' gradients
// accumulated in dk, dv (K × D, zeroed by the caller) over the group's heads and the queries.
template <int64_t kDim>
inline __attribute__((always_inline)) void backward_pair(const View& grad, const View& q, const View& k, const View& v, const View& out,
                                       const float* lse, const MaskView& mask, const Shapes& n,
                                       int64_t b, int64_t kv_head, float scale, float* scores, float* dscores,
                                       int8_t* keep, float* dq, float* dk, float* dv) {
  const int64_t group = n.query_heads / n.kv_heads;
  for (int64_t i = 0; i < n.queries; ++i) {
    mask.row(b, i, n.keys, keep);
    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      float* dq_row = dq + ((b * n.query_heads + h) * n.queries + i) * kDim;
      const float row_lse = lse[(b * n.query_heads + h) * n.queries + i];
      if (row_lse == std::numeric_limits<float>::infinity()) {
        for (int64_t d = 0; d < kDim; ++d) dq_row[d] = 0.0f;
        continue;
      }
      const float *q_row = q.at(b, h, i), *g_row = grad.at(b, i, h), *o_row = out.at(b, i, h);
      Floats16 dots = {};
      for (int64_t c = 0; c < kDim / 16; ++c) dots += load16(g_row + 16 * c) * load16(o_row + 16 * c);
      const float delta = reduce(dots, [](Floats16 a, Floats16 c) { return a + c; });  // Σ_d dO·O = Σ_j p·dp
      scores_of<kDim>(q_row, k, b, kv_head, n.keys, keep, scale, scores);
      Floats16 grad_vector[kDim / 16];
      for (int64_t c = 0; c < kDim / 16; ++c) grad_vector[c] = load16(g_row + 16 * c);
      for (int64_t j = 0; j < n.keys; j += 16) {
        Floats16 probabilities, changes;
#pragma omp simd
        for (int64_t lane = 0; lane < 16; ++lane) probabilities[lane] = exp_nonpositive(scores[j + lane] - row_lse);
        const Floats16 dp = block_scores<kDim>(grad_vector, v.at(b, kv_head, j), v.s2, n.keys - j);  // dO · v_j
        changes = probabilities * (dp - delta);
        __builtin_memcpy(scores + j, &probabilities, sizeof(probabilities));
        __builtin_memcpy(dscores + j, &changes, sizeof(changes));
      }
      Floats16 dq_sum[kDim / 16], q_vector[kDim / 16];
      weighted_rows<kDim>(dscores, k.at(b, kv_head, 0), k.s2, n.keys, dq_sum);
      for (int64_t c = 0; c < kDim / 16; ++c) q_vector[c] = load16(q_row + 16 * c);
      for (int64_t j = 0; j < n.keys; ++j) {
        const float change = dscores[j], probability = scores[j];
        if (probability == 0.0f) continue;  // masked (or underflowed): adds nothing to the key's or value's gradient
        float *dk_row = dk + j * kDim, *dv_row = dv + j * kDim;
        for (int64_t c = 0; c < kDim / 16; ++c) {
          const Floats16 dk_new = load16(dk_row + 16 * c) + (scale * change) * q_vector[c];
          const Floats16 dv_new = load16(dv_row + 16 * c) + probability * grad_vector[c];
          __builtin_memcpy(dk_row + 16 * c, &dk_new, sizeof(dk_new));
          __builtin_memcpy(dv_row + 16 * c, &dv_new, sizeof(dv_new));
        }
      }
      for (int64_t c = 0; c < kDim / 16; ++c) {
        const Floats16 result = scale * dq_sum[c];
        __builtin_memcpy(dq_row + 16 * c, &result, sizeof(result));
      }
    }
  }
}

#define FLOWKIT_PAIRS(DIM)                                                                                        \
  FLOWKIT_SIMD_CLONES void forward_pair_##DIM(const View& q, const View& k, const View& v, const MaskView& mask,     \
                                               const Shapes& n, int64_t b, int64_t kv_head, float scale,              \
                                               float* scores, int8_t* keep, float* out, float* lse) {                \
    forward_pair<DIM>(q, k, v, mask, n, b, kv_head, scale, scores, keep, out, lse);                                   \
  }                                                                                                                   \
  FLOWKIT_SIMD_CLONES void backward_pair_##DIM(const View& grad, const View& q, const View& k, const View& v,         \
                                                const View& out, const float* lse, const MaskView& mask,              \
                                                const Shapes& n, int64_t b, int64_t kv_head, float scale,             \
                                                float* scores, float* dscores, int8_t* keep, float* dq, float* dk,   \
                                                float* dv) {                                                          \
    backward_pair<DIM>(grad, q, k, v, out, lse, mask, n, b, kv_head, scale, scores, dscores, keep, dq, dk, dv);      \
  }
FLOWKIT_PAIRS(32)
FLOWKIT_PAIRS(64)
FLOWKIT_PAIRS(128)
#undef FLOWKIT_PAIRS

View view_of(const at::Tensor& t) { return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)}; }

Shapes check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "query (B, H, Q, D), key and value (B, Hkv, K, D)");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(3) == 1, "float32 tensors with a dense last dimension");
  const int64_t dim = query.size(3);
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "head dimension 32, 64 or 128, got ", dim);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == dim &&
                  query.size(1) % key.size(1) == 0,
              "key and value must be (B, Hkv, K, D) of the query's B and D, Hkv dividing H");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == query.size(0) &&
                  mask.size(1) == 1 && mask.size(2) == query.size(2) && mask.size(3) == key.size(2),
              "mask must be bool (B, 1, Q, K)");
  return {query.size(1), key.size(1), query.size(2), key.size(2)};
}

template <typename Task>
void for_each_pair(const Shapes& n, int64_t rows, Task task) {
  at::parallel_for(0, rows * n.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores((n.keys + 15) / 16 * 16), dscores(scores.size());
    std::vector<int8_t> keep(scores.size(), 0);  // whole blocks of 16, the tail never attended
    for (int64_t pair = begin; pair < end; ++pair)
      task(pair / n.kv_heads, pair % n.kv_heads, scores.data(), dscores.data(), keep.data());
  });
}

std::tuple<at::Tensor, at::Tensor> short_attention_cpu(const at::Tensor& query, const at::Tensor& key,
                                                       const at::Tensor& value, const at::Tensor& mask, double scale) {
  const Shapes n = check_inputs(query, key, value, mask);
  const int64_t rows = query.size(0), dim = query.size(3);
  at::Tensor out = at::empty({rows, n.queries, n.query_heads, dim}, query.options());
  at::Tensor lse = at::empty({rows, n.query_heads, n.queries}, query.options());
  const View q = view_of(query), k = view_of(key), v = view_of(value);
  const MaskView keep_mask{mask.data_ptr<bool>(), mask.stride(0), mask.stride(2), mask.stride(3)};
  float *o = out.data_ptr<float>(), *l = lse.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for_each_pair(n, rows, [&](int64_t b, int64_t h, float* scores, float*, int8_t* keep) {
    const auto pair = dim == 32 ? forward_pair_32 : dim == 64 ? forward_pair_64 : forward_pair_128;
    pair(q, k, v, keep_mask, n, b, h, s, scores, keep, o, l);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_backward_cpu(
    const at::Tensor& grad, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& mask, double scale) {
  const Shapes n = check_inputs(query, key, value, mask);
  const int64_t rows = query.size(0), dim = query.size(3);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 4 && grad.stride(3) == 1 &&
                  grad.sizes() == out.sizes() && out.is_contiguous() && lse.is_contiguous() &&
                  out.size(0) == rows && out.size(1) == n.queries && out.size(2) == n.query_heads &&
                  lse.numel() == rows * n.query_heads * n.queries,
              "grad and out (B, Q, H, D) and lse (B, H, Q) as the forward returned them");
  at::Tensor dq = at::empty({rows, n.query_heads, n.queries, dim}, query.options());
  at::Tensor dk = at::zeros({rows, n.kv_heads, n.keys, dim}, query.options());
  at::Tensor dv = at::zeros_like(dk);
  const View g = view_of(grad), q = view_of(query), k = view_of(key), v = view_of(value), o = view_of(out);
  const MaskView keep_mask{mask.data_ptr<bool>(), mask.stride(0), mask.stride(2), mask.stride(3)};
  const float* l = lse.data_ptr<float>();
  float *dq_ptr = dq.data_ptr<float>(), *dk_ptr = dk.data_ptr<float>(), *dv_ptr = dv.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for_each_pair(n, rows, [&](int64_t b, int64_t h, float* scores, float* dscores, int8_t* keep) {
    const int64_t offset = (b * n.kv_heads + h) * n.keys * dim;
    const auto pair = dim == 32 ? backward_pair_32 : dim == 64 ? backward_pair_64 : backward_pair_128;
    pair(g, q, k, v, o, l, keep_mask, n, b, h, s, scores, dscores, keep, dq_ptr, dk_ptr + offset, dv_ptr + offset);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowkit, CPU, m) {
  m.impl("short_attention", &short_attention_cpu);
  m.impl("short_attention_backward", &short_attention_backward_cpu);
}

}  // namespace flowkit
