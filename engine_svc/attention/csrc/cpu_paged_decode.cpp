// Paged decode attention on CPU, reading K/V blocks where they lie in the cache (no gather).
//
// One query token per request (a decode). Cache: head-major blocks [2, num_blocks, Hkv, block_size, D]
// (engine_svc/attention/torch_backend.py), so the keys of one (block, KV head) pair are one contiguous
// [block_size, D] run. Work item = (request, KV head): its H / Hkv query heads are scored against every
// context position block by block, softmaxed and applied to the values, all accumulated in float32;
// only the output is rounded to the model dtype. Items run in parallel on torch's intra-op pool.
// Per layer, optionally (gpt-oss, Mistral-style windows): a sliding window W (the query at position
// seq_len - 1 sees keys from seq_len - W on: blocks before the window's first block are never read, and
// may hold another request's K/V) and attention sinks (one logit per query head joins the softmax's max
// and denominator, with no value).
// Where the build has AVX512-BF16, bfloat16 with 16-token blocks scores keys with vdpbf16ps and (head_dim
// 64) sums values in registers; everything else, and `paged_decode_portable`, takes the portable loops.
#include "cpu_math.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_AVX512_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using tandem::as_float;

// dst [D, block_size] = the block's first n key rows [n, D] transposed, in float32; columns n.. zeroed.
template <typename T>
inline void keys_transposed(const T* src, float* dst, int64_t n, int64_t block_size, int64_t head_dim) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < head_dim; ++d) dst[d * block_size + t] = as_float(src[t * head_dim + d]);
  for (int64_t d = 0; d < head_dim; ++d)
    for (int64_t t = n; t < block_size; ++t) dst[d * block_size + t] = 0.f;
}

// s[0, BS) = q . k_t[:, t] for a block of BS keys transposed [D, BS]: the BS scores stay in registers
// (one vector for BS = 16 floats), each query element scaling one row of the block (no horizontal sums).
template <int64_t BS>
inline void block_scores(const float* q, const float* k_t, float* s, int64_t head_dim) {
  float acc[BS] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const float qd = q[d];
#pragma omp simd
    for (int64_t t = 0; t < BS; ++t) acc[t] += qd * k_t[d * BS + t];
  }
  for (int64_t t = 0; t < BS; ++t) s[t] = acc[t];
}

// The same for a block size known only at run time (the scores accumulate in memory).
inline void block_scores_any(const float* q, const float* k_t, float* s, int64_t head_dim, int64_t block_size) {
  for (int64_t t = 0; t < block_size; ++t) s[t] = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float qd = q[d];
#pragma omp simd
    for (int64_t t = 0; t < block_size; ++t) s[t] += qd * k_t[d * block_size + t];
  }
}

// y[0, n) += alpha * x[0, n), x converted to float32 element by element.
template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * as_float(x[i]);
}

#ifdef TANDEM_AVX512_BF16
// r[p] lane t <- r[t] lane p: a 16 x 16 transpose of 32-bit elements in registers (interleave 32- and
// 64-bit elements within 128-bit lanes, then move 128-bit lanes).
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 2; ++j) {
    for (int k = 0; k < 4; ++k) {
      t[8 * j + k] = _mm512_shuffle_i32x4(r[8 * j + k], r[8 * j + 4 + k], 0x88);
      t[8 * j + 4 + k] = _mm512_shuffle_i32x4(r[8 * j + k], r[8 * j + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
}

// AVX512-BF16 scores of one 16-key block: s[t] = scale * sum_d q_g[d] k_t[d] for the group's query rows,
// straight from the bfloat16 cache. Per pair of head dims p, one register holds the 16 keys' (2p, 2p+1)
// pairs (a 32-bit lane each) and vdpbf16ps adds q[2p] k[2p] + q[2p+1] k[2p+1] to each key's lane: the
// 16 scores stay in one register, products are exact and sums are float32 (as the portable kernel).
// Those registers come from a register transpose of 16 pairs of all 16 keys at a time where head_dim is a
// multiple of 32 (a gather per pair otherwise: the same lanes, many times slower on CPUs whose gathers
// are microcoded); both add the pairs in the same order, so both give the same bits.
// head_dim even; q rows dense bfloat16, not scaled.
// NG query rows (a compile-time count, so that the accumulators stay in registers) against one block.
template <int NG>
inline void block_scores_bf16_rows(const at::BFloat16* const* q_rows, const int32_t* k32, int32_t pairs,
                                   bool transposed, __m512i rows, float scale, float* const* s) {
  __m512 acc[NG];
  __m512i k_pairs[16];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int32_t p = 0; p < pairs; ++p) {
    __m512i k;
    if (transposed) {
      if (p % 16 == 0) {  // pairs [p, p + 16) of the 16 keys, one key per register, then transposed
        for (int t = 0; t < 16; ++t) k_pairs[t] = _mm512_loadu_si512(k32 + t * pairs + p);
        transpose_16x16(k_pairs);
      }
      k = k_pairs[p % 16];
    } else {
      k = _mm512_i32gather_epi32(rows, k32 + p, 4);
    }
    for (int g = 0; g < NG; ++g) {
      int32_t qp;
      std::memcpy(&qp, q_rows[g] + 2 * p, sizeof(qp));
      acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)k, (__m512bh)_mm512_set1_epi32(qp));
    }
  }
  for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s[g], _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
}

inline void block_scores_bf16(const at::BFloat16* const* q_rows, const at::BFloat16* keys, int64_t group,
                              int64_t head_dim, float scale, float* const* s) {
  const int32_t* k32 = reinterpret_cast<const int32_t*>(keys);
  const int32_t pairs = static_cast<int32_t>(head_dim / 2);
  const bool transposed = pairs % 16 == 0;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(pairs));
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 query rows a pass
    const at::BFloat16* const* q = q_rows + g0;
    float* const* out = s + g0;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: block_scores_bf16_rows<1>(q, k32, pairs, transposed, rows, scale, out); break;
      case 2: block_scores_bf16_rows<2>(q, k32, pairs, transposed, rows, scale, out); break;
      case 3: block_scores_bf16_rows<3>(q, k32, pairs, transposed, rows, scale, out); break;
      default: block_scores_bf16_rows<4>(q, k32, pairs, transposed, rows, scale, out); break;
    }
  }
}
#endif

#ifdef TANDEM_AVX512_BF16
// acc[g, 0:64] = sum_pos scores[g, pos] * v_pos for head_dim 64: each value row converted once (4 float32
// vectors) and the group's accumulators held in registers, 4 query heads a pass.
// Positions [lo, seq_len); scores[g * padded + pos - base] holds position pos's score.
template <int NG>
inline void weighted_values_64_rows(const float* scores, int64_t padded, int64_t base, int64_t lo, int64_t seq_len,
                                    const at::BFloat16* v_base, const int32_t* blocks, int64_t num_kv_heads,
                                    int64_t kv_head, int64_t run, int64_t block_size, float* acc_out) {
  __m512 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t pos0 = base; pos0 < seq_len; pos0 += block_size) {  // block by block: no division per row
    const at::BFloat16* block_v = v_base + (blocks[pos0 / block_size] * num_kv_heads + kv_head) * run;
    const int64_t first = std::max(lo, pos0), last = std::min(seq_len, pos0 + block_size);
    for (int64_t pos = first; pos < last; ++pos) {
      const at::BFloat16* v = block_v + (pos - pos0) * 64;
      __m512 x[4];
      for (int c = 0; c < 4; ++c)
        x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c))), 16));
      for (int g = 0; g < NG; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * padded + pos - base]);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, x[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + g * 64 + 16 * c, acc[g][c]);
}

inline void weighted_values_64(const float* scores, int64_t padded, int64_t base, int64_t lo, int64_t seq_len,
                               const at::BFloat16* v_base, const int32_t* blocks, int64_t num_kv_heads,
                               int64_t kv_head, int64_t run, int64_t block_size, int64_t group, float* acc_out) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 query heads a pass
    const float* sc = scores + g0 * padded;
    float* out = acc_out + g0 * 64;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: weighted_values_64_rows<1>(sc, padded, base, lo, seq_len, v_base, blocks, num_kv_heads, kv_head, run, block_size, out); break;
      case 2: weighted_values_64_rows<2>(sc, padded, base, lo, seq_len, v_base, blocks, num_kv_heads, kv_head, run, block_size, out); break;
      case 3: weighted_values_64_rows<3>(sc, padded, base, lo, seq_len, v_base, blocks, num_kv_heads, kv_head, run, block_size, out); break;
      default: weighted_values_64_rows<4>(sc, padded, base, lo, seq_len, v_base, blocks, num_kv_heads, kv_head, run, block_size, out); break;
    }
  }
}
#endif

// max(init, s[0, n)) in 16 independent lanes (the compiler makes them one vector; a plain running
// std::max stays one scalar dependency chain). Exact in any order for the finite scores it is given.
inline float row_max(const float* s, int64_t n, float init) {
  float lanes[16];
  for (int l = 0; l < 16; ++l) lanes[l] = init;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = s[i + l] > lanes[l] ? s[i + l] : lanes[l];
  for (; i < n; ++i) lanes[0] = s[i] > lanes[0] ? s[i] : lanes[0];
  float mx = lanes[0];
  for (int l = 1; l < 16; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  return mx;
}

// Whether this build scores bfloat16 blocks with AVX512-BF16 (block size 16, even head_dim) unless
// `portable` asks for the compiler-vectorised float32 path every CPU runs.
template <typename T>
inline bool use_bf16_dot(bool portable, int64_t block_size, int64_t head_dim) {
#ifdef TANDEM_AVX512_BF16
  return std::is_same_v<T, at::BFloat16> && !portable && block_size == 16 && head_dim % 2 == 0;
#else
  return false;
#endif
}

template <typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, double scale, const float* sinks, int64_t window, at::Tensor& out,
                   bool portable) {
  const int64_t num_reqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads, table_width = block_table.size(1);
  const T* q_base = query.data_ptr<T>();
  const int64_t q_req_stride = query.stride(0), q_head_stride = query.stride(1);
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * num_kv_heads * block_size * head_dim;
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* out_base = out.data_ptr<T>();
  const int64_t run = block_size * head_dim;  // one (block, KV head) run of keys or values
  const float fscale = static_cast<float>(scale);
  const bool bf16_dot = use_bf16_dot<T>(portable, block_size, head_dim);

  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), k_t(run), acc(group * head_dim), inv_sum(group), scores;
    std::vector<const T*> q_rows(group);
    std::vector<float*> s_rows(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t req = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq_len = lens[req];
      // positions [lo, seq_len) are seen; scores start at `base`, the first seen block's first position
      const int64_t lo = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
      const int64_t base = lo / block_size * block_size;
      const int64_t padded = (seq_len + block_size - 1) / block_size * block_size - base;
      const int32_t* blocks = table + req * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_rows[g] = q_base + req * q_req_stride + (kv_head * group + g) * q_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = as_float(src[d]) * fscale;
      }
      scores.resize(group * padded);
#ifdef TANDEM_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (bf16_dot) {
          for (int64_t pos0 = base; pos0 < seq_len; pos0 += block_size) {
            const T* keys = k_base + (blocks[pos0 / block_size] * num_kv_heads + kv_head) * run;
            for (int64_t g = 0; g < group; ++g) s_rows[g] = scores.data() + g * padded + pos0 - base;
            // a partial last block scores its tail from finite cache values; the softmax never reads them
            block_scores_bf16(q_rows.data(), keys, group, head_dim, fscale, s_rows.data());
          }
        }
      }
#endif
      // scores[g, pos] = q_g . k_pos, a block's keys transposed so that each query element scales a
      // vector of block_size keys' elements (no horizontal sum per score)
      for (int64_t pos0 = base; pos0 < seq_len && !bf16_dot; pos0 += block_size) {
        const int64_t n = std::min(block_size, seq_len - pos0);
        const int64_t block = blocks[pos0 / block_size];
        keys_transposed(k_base + (block * num_kv_heads + kv_head) * run, k_t.data(), n, block_size, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * padded + pos0 - base;
          if (block_size == 16) {
            block_scores<16>(q.data() + g * head_dim, k_t.data(), s, head_dim);
          } else {
            block_scores_any(q.data() + g * head_dim, k_t.data(), s, head_dim, block_size);
          }
        }
      }
      // softmax per query head over [lo, seq_len) and its sink (unnormalised; the sum divides the output)
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * padded + (lo - base);  // s[i]: position lo + i's score
        const int64_t n = seq_len - lo;
        const float sink = sinks != nullptr ? sinks[kv_head * group + g] : 0.f;
        float mx = sinks != nullptr ? sink : -std::numeric_limits<float>::infinity();
        mx = row_max(s, n, mx);
        float sum = sinks != nullptr ? tandem::exp_clamped(sink - mx) : 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = tandem::exp_clamped(s[i] - mx);
          sum += s[i];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      bool values_done = false;
#ifdef TANDEM_AVX512_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (bf16_dot && head_dim == 64) {
          weighted_values_64(scores.data(), padded, base, lo, seq_len, v_base, blocks, num_kv_heads, kv_head, run,
                             block_size, group, acc.data());
          values_done = true;
        }
      }
#endif
      for (int64_t pos0 = base; pos0 < seq_len && !values_done; pos0 += block_size) {
        const int64_t n = std::min(block_size, seq_len - pos0);
        const T* v = v_base + (blocks[pos0 / block_size] * num_kv_heads + kv_head) * run;
        for (int64_t t = std::max<int64_t>(0, lo - pos0); t < n; ++t)
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * padded + pos0 - base + t], v + t * head_dim, acc.data() + g * head_dim, head_dim);
      }
      T* dst = out_base + (req * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) dst[g * head_dim + d] = tandem::from_float<T>(acc[g * head_dim + d] * inv_sum[g]);
    }
  });
}

// query [B, H, D] (any request / head strides, dense rows: a view into the qkv projection), kv_cache [2, num_blocks, Hkv, block_size, D] (same dtype, contiguous), block_table
// [>= B, width] int32, seq_lens [>= B] int32 (each >= 1, covered by the table); returns [B, H, D].
// `sinks` [H] (any float dtype) or None; `window` > 0: keys from seq_len - window on only (0: all).
// Only the table entries of the blocks read are checked (those before the window may be placeholders).
// `portable` keeps bfloat16 on the float32 path CPUs without AVX512-BF16 take (tests compare the two).
at::Tensor paged_decode_impl(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& sinks,
                             int64_t window, bool portable) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: bad shapes");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "paged_decode: query and cache dtypes differ");
  TORCH_CHECK(query.stride(2) == 1 && kv_cache.is_contiguous(),
              "paged_decode: the cache must be contiguous and each query head's row dense");
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && query.size(1) % kv_cache.size(2) == 0,
              "paged_decode: head dims / GQA grouping do not match the cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous() && seq_lens.is_contiguous() &&
                  block_table.size(0) >= query.size(0) && seq_lens.size(0) >= query.size(0),
              "paged_decode: block_table / seq_lens do not cover the batch");
  const int64_t block_size = kv_cache.size(3), width = block_table.size(1), num_blocks = kv_cache.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0");
  at::Tensor sink_logits;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == query.size(1), "paged_decode: sinks must be [num_heads]");
    sink_logits = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_ptr = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < query.size(0); ++r) {
    TORCH_CHECK(lens[r] >= 1 && (lens[r] - 1) / block_size < width, "paged_decode: seq_len out of range");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
    for (int64_t b = lo / block_size; b <= (lens[r] - 1) / block_size; ++b)
      TORCH_CHECK(table[r * width + b] >= 0 && table[r * width + b] < num_blocks, "paged_decode: block out of range");
  }
  at::Tensor out = at::empty(query.sizes(), query.options());  // contiguous [B, H, D]
  if (query.scalar_type() == at::kFloat) {
    decode_kernel<float>(query, kv_cache, block_table, seq_lens, scale, sink_ptr, window, out, portable);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(query, kv_cache, block_table, seq_lens, scale, sink_ptr, window, out, portable);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  }
  return out;
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                        const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& sinks,
                        int64_t window) {
  return paged_decode_impl(query, kv_cache, block_table, seq_lens, scale, sinks, window, false);
}

at::Tensor paged_decode_portable(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& sinks,
                                 int64_t window) {
  return paged_decode_impl(query, kv_cache, block_table, seq_lens, scale, sinks, window, true);
}

bool has_avx512_bf16() {
#ifdef TANDEM_AVX512_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace

// cpu_fused_ops.cpp
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cache);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention reading the KV blocks in place",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sinks") = py::none(), py::arg("window") = 0);
  m.def("paged_decode_portable", &paged_decode_portable,
        "paged_decode on the portable path (bfloat16 without AVX512-BF16 dot products), for tests",
        py::arg("query"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sinks") = py::none(), py::arg("window") = 0);
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether bfloat16 decodes score keys with AVX512-BF16");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("silu_and_mul", &silu_and_mul, "[gate | up] -> silu(gate) * up");
  m.def("rotary_", &rotary_, "rotary embedding of [T, H, D] rows in place from a (cos, signed sin) cache");
}
