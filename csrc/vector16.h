// Floats16: 16 floats as one value (GCC's vector extension: AVX-512 registers in the avx512f clones, pairs or quads
// of narrower ones in the others), and the decoding attention kernel's dot products of a query with 16 keys at once.
#pragma once

#include <cstdint>

namespace flowkit {

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

// sum = Σ_j weights[j] · row j for `count` rows of kDim floats `step` apart (kDim a multiple of 16), over four
// accumulators so consecutive rows' multiply-adds do not wait on each other. Row j always goes to accumulator j % 4,
// so rows of weight 0 after the last (masked keys past a row's end) leave the sum exactly as it was.
template <int64_t kDim>
inline __attribute__((always_inline)) void weighted_rows(const float* weights, const float* rows, int64_t step,
                                                         int64_t count, Floats16* sum) {
  Floats16 partial[4][kDim / 16] = {};
  int64_t j = 0;
  for (; j + 4 <= count; j += 4)
    for (int64_t u = 0; u < 4; ++u)
      for (int64_t c = 0; c < kDim / 16; ++c) partial[u][c] += weights[j + u] * load16(rows + (j + u) * step + 16 * c);
  for (; j < count; ++j)
    for (int64_t c = 0; c < kDim / 16; ++c) partial[j % 4][c] += weights[j] * load16(rows + j * step + 16 * c);
  for (int64_t c = 0; c < kDim / 16; ++c) sum[c] = (partial[0][c] + partial[1][c]) + (partial[2][c] + partial[3][c]);
}

}  // namespace flowkit
