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

namespace flowkit {
namespace {

// 16 floats as one value (GCC's vector extension: AVX-512 registers in the avx512f clone, pairs or quads of narrower
// ones in the others).
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t Lanes16 __attribute__((vector_size(64)));
typedef int8_t Bytes16 __attribute__((vector_size(16)));

inline __attribute__((always_inline)) Floats16 load16(const float* p) {
  Floats16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Pairwise sums of a's and b's lanes in blocks of `width`: lanes [a's block 0 + a's block 1, b's block 0 + b's block
// 1, a's block 2 + a's block 3, …] — one level of the tree that turns 16 vectors of partial dot products into one
// vector of the 16 dot products, in key order (instead of 16 sequential additions per key).
template <int width>
inline __attribute__((always_inline)) Floats16 fold(Floats16 a, Floats16 b) {
  Lanes16 low, high;
  for (int lane = 0; lane < 16; ++lane) {
    const int block = lane / width, offset = lane % width, pair = block / 2, from_b = block % 2;
    low[lane] = pair * 2 * width + offset + 16 * from_b;
    high[lane] = low[lane] + width;
  }
  return __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
}

// combine(…combine(lane 0, lane 1)…, lane 15) as a tree of log2(16) steps (max or sum of the lanes).
template <typename Combine>
inline __attribute__((always_inline)) float reduce(Floats16 v, Combine combine) {
  const Lanes16 eight = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const Lanes16 four = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const Lanes16 two = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const Lanes16 one = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v = combine(v, __builtin_shuffle(v, eight));
  v = combine(v, __builtin_shuffle(v, four));
  v = combine(v, __builtin_shuffle(v, two));
  return combine(v, __builtin_shuffle(v, one))[0];
}

// The 16 lane sums whose total is q · key (q: kDim floats as vectors, kDim a multiple of 16).
template <int64_t kDim>
inline __attribute__((always_inline)) Floats16 key_partial(const Floats16* q, const float* key) {
  Floats16 sum = q[0] * load16(key);
  for (int64_t c = 1; c < kDim / 16; ++c) sum += q[c] * load16(key + 16 * c);
  return sum;
}

// q · key for the 16 keys from `keys` (count ≤ 16 of them real; the rest score 0), q of kDim floats (a multiple of
// 16) held as vectors; each key's partial products are folded as soon as its pair is in, to keep few vectors live.
template <int64_t kDim>
inline __attribute__((always_inline)) Floats16 block_scores(const Floats16* q, const float* keys, int64_t k_step,
                                                             int64_t count) {
  const Floats16 zero = {};
  Floats16 eights[8];
  for (int64_t j = 0; j < 8; ++j) {
    const Floats16 low = j < count ? key_partial<kDim>(q, keys + j * k_step) : zero;
    const Floats16 high = j + 8 < count ? key_partial<kDim>(q, keys + (j + 8) * k_step) : zero;
    eights[j] = fold<8>(low, high);
  }
  Floats16 fours[4], twos[2];
  for (int j = 0; j < 4; ++j) fours[j] = fold<4>(eights[j], eights[j + 4]);
  for (int j = 0; j < 2; ++j) twos[j] = fold<2>(fours[j], fours[j + 2]);
  return fold<1>(twos[0], twos[1]);
}

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
      Floats16 sum[kDim / 16] = {};
      for (int64_t l = 0; l < length; ++l) {
        const float* value = v + l * v_step;
        for (int64_t c = 0; c < kDim / 16; ++c) sum[c] += scores[l] * load16(value + 16 * c);
      }
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
