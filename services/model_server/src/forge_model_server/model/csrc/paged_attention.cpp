// Decode attention over the paged KV cache in one pass: forge::paged_decode_attention.
//
// One query token per sequence attends to the keys and values of its blocks where they lie in
// the pool (PagedAttention's access pattern), with an online softmax (running max and sum, as
// flash-decoding does), so each key and value is read once and nothing is written but the output.
// Threads (torch's intra-op pool) split the sequences; the query heads of one KV head (GQA) share
// each block's reads while it is in L1. Each head's part of a block is 4-8 KB of contiguous keys
// and as many values, which the hardware prefetcher streams; software prefetches of the next
// block (tried) competed with those streams and made the kernel 25-30% slower.
//
//   out          [seqs, heads, dim]                      float32, written
//   query        [seqs, heads, dim]                      float32
//   k_cache      [blocks, kv_heads, block_size, dim]     float32 (one layer's pool)
//   v_cache      [blocks, kv_heads, block_size, dim]     float32
//   block_tables [seqs, max_blocks]                      int32, a sequence's blocks in position order
//   context_lens [seqs]                                  int32, positions each sequence sees (>= 1)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // floats per independent partial sum: one AVX-512 register

// exp(x) for x <= 0 (scores minus their running max), written as plain loops the compiler
// vectorizes: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (relative error
// within a few float ulps), 2^n put in the exponent bits. Clamped at -87 (e^-87 ~ 1.6e-38), so
// nothing falls into denormals.
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::nearbyint(v * 1.44269504088896341f);
    const float r = v - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    x[i] = p * two_k;
  }
}

// One sequence and one query head against one block: fold the block into the running max
// ``top``, sum ``total`` and output ``acc`` (DIM floats, kept in registers when DIM is fixed).
template <int64_t DIM>
inline void attend_block(const float* __restrict q, const float* __restrict keys, const float* __restrict values,
                         int64_t valid, float softmax_scale, float* __restrict score, float& top, float& total,
                         float* __restrict acc, int64_t dim_runtime) {
  const int64_t dim = DIM > 0 ? DIM : dim_runtime;
  float best = top;
  for (int64_t t = 0; t < valid; ++t) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= dim; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) part[j] += q[i + j] * keys[t * dim + i + j];
    }
    for (; i < dim; ++i) part[0] += q[i] * keys[t * dim + i];
    float sum = 0.0f;
    for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
    score[t] = sum * softmax_scale;
    best = std::max(best, score[t]);
  }
  if (best > top) {  // a new running max: rescale what was summed so far
    float shrink = top - best;
    exp_nonpositive(&shrink, 1);
    total *= shrink;
    for (int64_t i = 0; i < dim; ++i) acc[i] *= shrink;
    top = best;
  }
  for (int64_t t = 0; t < valid; ++t) score[t] -= best;
  exp_nonpositive(score, valid);
  for (int64_t t = 0; t < valid; ++t) {
    total += score[t];
    for (int64_t i = 0; i < dim; ++i) acc[i] += score[t] * values[t * dim + i];
  }
}

#if defined(__AVX512F__)
// The same fold with AVX-512 intrinsics, for head sizes that are whole registers (64, 128): the
// query's registers are loaded once per block, each key's dot product is one register reduced by
// a shuffle tree (the portable loop above ends each key with sixteen dependent scalar adds, which
// bounded the whole kernel), and the output's registers stay in registers across the block.
template <int64_t DIM>
inline void attend_block_avx512(const float* __restrict q, const float* __restrict keys,
                                const float* __restrict values, int64_t valid, float softmax_scale,
                                float* __restrict score, float& top, float& total, float* __restrict acc,
                                int64_t /*dim_runtime*/) {
  static_assert(DIM % 16 == 0, "a whole number of AVX-512 registers");
  constexpr int64_t kRegs = DIM / 16;
  __m512 qv[kRegs];
  for (int64_t i = 0; i < kRegs; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  float best = top;
  for (int64_t t = 0; t < valid; ++t) {
    const float* k = keys + t * DIM;
    __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int64_t i = 1; i < kRegs; ++i) dot = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), dot);
    score[t] = _mm512_reduce_add_ps(dot) * softmax_scale;
    best = std::max(best, score[t]);
  }
  __m512 out[kRegs];
  for (int64_t i = 0; i < kRegs; ++i) out[i] = _mm512_loadu_ps(acc + 16 * i);
  if (best > top) {
    float shrink = top - best;
    exp_nonpositive(&shrink, 1);
    total *= shrink;
    const __m512 s = _mm512_set1_ps(shrink);
    for (int64_t i = 0; i < kRegs; ++i) out[i] = _mm512_mul_ps(out[i], s);
    top = best;
  }
  for (int64_t t = 0; t < valid; ++t) score[t] -= best;
  exp_nonpositive(score, valid);
  for (int64_t t = 0; t < valid; ++t) {
    total += score[t];
    const __m512 p = _mm512_set1_ps(score[t]);
    const float* v = values + t * DIM;
    for (int64_t i = 0; i < kRegs; ++i) out[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * i), out[i]);
  }
  for (int64_t i = 0; i < kRegs; ++i) _mm512_storeu_ps(acc + 16 * i, out[i]);
}
#endif

using BlockFn = void (*)(const float*, const float*, const float*, int64_t, float, float*, float&, float&, float*,
                         int64_t);

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double softmax_scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [seqs, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [blocks, kv_heads, block_size, dim]");
  for (const at::Tensor* t : {&out, &query, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "out, query and the caches must be contiguous float32 CPU tensors");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [seqs, max_blocks] tensor");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 && context_lens.is_contiguous(),
              "context_lens must be a contiguous int32 [seqs] tensor");
  const int64_t seqs = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0), kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim, "the caches' head_dim differs from the query's");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == seqs && context_lens.size(0) == seqs,
              "block_tables and context_lens need one row per sequence");
  const int64_t groups = heads / kv_heads, max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size,
                "context length ", lens[s], " of sequence ", s, " does not fit its block table");
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " of sequence ", s, " is outside the pool");
    }
  }
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float scale_f = static_cast<float>(softmax_scale);

#if defined(__AVX512F__)
  const BlockFn attend = dim == 64    ? &attend_block_avx512<64>
                         : dim == 128 ? &attend_block_avx512<128>
                                      : &attend_block<0>;
#else
  const BlockFn attend = dim == 64 ? &attend_block<64> : dim == 128 ? &attend_block<128> : &attend_block<0>;
#endif
  const int64_t block_floats = kv_heads * block_size * dim;  // one block of one layer, all KV heads
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * dim), top(heads), total(heads), score(block_size);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t ctx = lens[s];
      const int32_t* table = tables + s * max_blocks;
      const float* q_s = q + s * heads * dim;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(total.begin(), total.end(), 0.0f);
      const int64_t used = (ctx + block_size - 1) / block_size;
      for (int64_t b = 0; b < used; ++b) {
        const int64_t valid = std::min(block_size, ctx - b * block_size);
        for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
          const float* keys = kc + table[b] * block_floats + kvh * block_size * dim;
          const float* values = vc + table[b] * block_floats + kvh * block_size * dim;
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t h = kvh * groups + g;
            attend(q_s + h * dim, keys, values, valid, scale_f, score.data(), top[h], total[h],
                   acc.data() + h * dim, dim);
          }
        }
      }
      float* o_s = o + s * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / total[h];
        for (int64_t i = 0; i < dim; ++i) o_s[h * dim + i] = acc[h * dim + i] * inv;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(forge, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float softmax_scale) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
