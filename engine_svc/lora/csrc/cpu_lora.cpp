// Multi-LoRA deltas on CPU for few tokens per adapter (decode): one call per LoRA layer, every slot's A and B
// read once for all the tokens routed to it, no gather/scatter of rows and no per-slot torch ops.
//
// lora_add_(x [T, in], out [T, N], a [S, W, in], b [S, R, N], offsets [P + 1], sorted [>= n] int32,
//           counts [U] int32, starts [U] int32)  (U <= S slots in use; W = P * R)
//   In place: for every slot s < U and every token t of sorted[starts[s] : starts[s] + counts[s]],
//   out[t, offsets[p] : offsets[p+1]] += (x[t] . a[s, p*R + r] for r < R) @ b[s, :, offsets[p] : offsets[p+1]]
//   for each sub-projection p. Tokens in no slot (base-model tokens) are never touched. The mapping is
//   kernels/lora_mapping.py's (tokens grouped by slot, each token at most once), so slots write disjoint rows.
// Numerics (kernels/lora_ref.py): the shrink x . a in float32, kept in float32; each sub-projection's delta
//   summed in float32 and added to out in float32, rounded once to out's dtype.
// Work: phase 1 runs (slot, block of tokens, block of A rows) items on torch's intra-op pool into a float32
// xa [n, W] in sorted order; phase 2 runs (slot, sub-projection, block of columns) items, each B row block
// read once for all the slot's tokens. x and out may have any row stride (their columns are unit-stride).
#include <torch/extension.h>

#include "cpu_math.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_LORA_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using tandem::as_float;  // cpu_math.h

constexpr int64_t kTok = 4;           // tokens per register block
constexpr int64_t kRow = 4;           // A rows per register block (shrink)
constexpr int64_t kLanes = 16;        // float32 lanes of one vector step
constexpr int64_t kItemTokens = 16;   // tokens per shrink work item
constexpr int64_t kItemRows = 8;      // A rows per shrink work item
constexpr int64_t kItemCols = 256;    // output columns per expand work item

#ifdef TANDEM_LORA_AVX512
// 16 lanes of a row as float32, the first `left` of them (the rest zero) when left < 16.
inline __m512 load16(const float* p, int64_t left) {
  if (left >= kLanes) return _mm512_loadu_ps(p);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), p);
}
inline __m512 load16(const at::BFloat16* p, int64_t left) {
  const __m256i h = left >= kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T, int NT, int NR>
inline void dots_avx512(const T* const* x, const T* const* a, int64_t n, float out[kTok][kRow]) {
  __m512 acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += kLanes) {
    const int64_t left = n - k;
    __m512 av[NR];
    for (int r = 0; r < NR; ++r) av[r] = load16(a[r] + k, left);
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = load16(x[t] + k, left);
      for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_fmadd_ps(xv, av[r], acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) out[t][r] = _mm512_reduce_add_ps(acc[t][r]);
}

template <typename T, int NT>
inline void axpys_avx512(const float* const* xa, const T* b, int64_t ld, int64_t rank, int64_t width,
                         float acc_out[kTok][kLanes]) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    const __m512 bv = load16(b + r * ld, width);
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(xa[t][r]), bv, acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc_out[t], acc[t]);
}
#endif

// acc[t][r] = x[t] . a[r] over n elements, NT tokens x NR rows held in vector accumulators.
template <typename T, int NT, int NR>
inline void dots(const T* const* x, const T* const* a, int64_t n, float out[kTok][kRow]) {
  float acc[NT][NR][kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    float av[NR][kLanes];
    for (int r = 0; r < NR; ++r)
      for (int64_t l = 0; l < kLanes; ++l) av[r][l] = as_float(a[r][k + l]);
    for (int t = 0; t < NT; ++t) {
      float xv[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) xv[l] = as_float(x[t][k + l]);
      for (int r = 0; r < NR; ++r)
        for (int64_t l = 0; l < kLanes; ++l) acc[t][r][l] += xv[l] * av[r][l];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) {
      float s = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) s += acc[t][r][l];
      for (int64_t kk = k; kk < n; ++kk) s += as_float(x[t][kk]) * as_float(a[r][kk]);
      out[t][r] = s;
    }
}

#ifdef TANDEM_LORA_AVX512
#define TANDEM_LORA_DOTS dots_avx512
#define TANDEM_LORA_AXPYS axpys_avx512
#else
#define TANDEM_LORA_DOTS dots
#define TANDEM_LORA_AXPYS axpys
#endif

template <typename T, int NT>
inline void dots_rows(const T* const* x, const T* const* a, int64_t nr, int64_t n, float out[kTok][kRow]) {
  switch (nr) {
    case 4: return TANDEM_LORA_DOTS<T, NT, 4>(x, a, n, out);
    case 3: return TANDEM_LORA_DOTS<T, NT, 3>(x, a, n, out);
    case 2: return TANDEM_LORA_DOTS<T, NT, 2>(x, a, n, out);
    default: return TANDEM_LORA_DOTS<T, NT, 1>(x, a, n, out);
  }
}

template <typename T>
inline void dots_any(const T* const* x, int64_t nt, const T* const* a, int64_t nr, int64_t n, float out[kTok][kRow]) {
  switch (nt) {
    case 4: return dots_rows<T, 4>(x, a, nr, n, out);
    case 3: return dots_rows<T, 3>(x, a, nr, n, out);
    case 2: return dots_rows<T, 2>(x, a, nr, n, out);
    default: return dots_rows<T, 1>(x, a, nr, n, out);
  }
}

// acc[t][c] += sum_r xa[t][r] * b[r][c] for c < kLanes (NT tokens, `rank` rows of b with row stride ld).
template <typename T, int NT>
inline void axpys(const float* const* xa, const T* b, int64_t ld, int64_t rank, int64_t width, float acc[kTok][kLanes]) {
  for (int64_t r = 0; r < rank; ++r) {
    float bv[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) bv[l] = l < width ? as_float(b[r * ld + l]) : 0.f;
    for (int t = 0; t < NT; ++t) {
      const float v = xa[t][r];
      for (int64_t l = 0; l < kLanes; ++l) acc[t][l] += v * bv[l];
    }
  }
}

template <typename T>
inline void axpys_any(const float* const* xa, int64_t nt, const T* b, int64_t ld, int64_t rank, int64_t width,
                      float acc[kTok][kLanes]) {
  switch (nt) {
    case 4: return TANDEM_LORA_AXPYS<T, 4>(xa, b, ld, rank, width, acc);
    case 3: return TANDEM_LORA_AXPYS<T, 3>(xa, b, ld, rank, width, acc);
    case 2: return TANDEM_LORA_AXPYS<T, 2>(xa, b, ld, rank, width, acc);
    default: return TANDEM_LORA_AXPYS<T, 1>(xa, b, ld, rank, width, acc);
  }
}

struct ShrinkItem {
  int64_t slot, first_token, first_row;
};
struct ExpandItem {
  int64_t slot, part, first_col;
};

template <typename T>
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
         const std::vector<int64_t>& offsets, const int32_t* sorted, const int32_t* counts, const int32_t* starts,
         int64_t used) {
  const int64_t in = x.size(1), width = a.size(1), rank = b.size(1), n_out = b.size(2);
  const int64_t x_ld = x.stride(0), out_ld = out.stride(0);
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  const T* as = a.data_ptr<T>();
  const T* bs = b.data_ptr<T>();
  int64_t adapter_tokens = 0;
  for (int64_t s = 0; s < used; ++s) adapter_tokens = std::max<int64_t>(adapter_tokens, starts[s] + counts[s]);
  std::vector<float> xa(static_cast<size_t>(adapter_tokens * width));

  // Phase 1: xa[pos, w] = x[sorted[pos]] . a[s, w] for the item's tokens and A rows.
  std::vector<ShrinkItem> shrink;
  for (int64_t s = 0; s < used; ++s)
    for (int64_t t = 0; t < counts[s]; t += kItemTokens)
      for (int64_t w = 0; w < width; w += kItemRows) shrink.push_back({s, t, w});
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t begin, int64_t end) {
    float res[kTok][kRow];
    for (int64_t it = begin; it < end; ++it) {
      const ShrinkItem item = shrink[it];
      const T* as_s = as + item.slot * width * in;
      const int64_t tok_end = std::min<int64_t>(item.first_token + kItemTokens, counts[item.slot]);
      const int64_t row_end = std::min(item.first_row + kItemRows, width);
      for (int64_t t0 = item.first_token; t0 < tok_end; t0 += kTok) {
        const int64_t nt = std::min(kTok, tok_end - t0);
        const int64_t pos0 = starts[item.slot] + t0;
        const T* rows[kTok];
        for (int64_t m = 0; m < nt; ++m) rows[m] = xs + static_cast<int64_t>(sorted[pos0 + m]) * x_ld;
        for (int64_t w0 = item.first_row; w0 < row_end; w0 += kRow) {
          const int64_t nr = std::min(kRow, row_end - w0);
          const T* arows[kRow];
          for (int64_t r = 0; r < nr; ++r) arows[r] = as_s + (w0 + r) * in;
          dots_any<T>(rows, nt, arows, nr, in, res);
          for (int64_t m = 0; m < nt; ++m)
            for (int64_t r = 0; r < nr; ++r) xa[(pos0 + m) * width + w0 + r] = res[m][r];
        }
      }
    }
  });

  // Phase 2: out[t, cols] = round(out[t, cols] + xa[pos, p*R : (p+1)*R] @ b[s, :, cols]) per column block.
  std::vector<ExpandItem> expand;
  for (int64_t s = 0; s < used; ++s)
    if (counts[s] > 0)
      for (int64_t p = 0; p < parts; ++p)
        for (int64_t c = offsets[p]; c < offsets[p + 1]; c += kItemCols) expand.push_back({s, p, c});
  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t begin, int64_t end) {
    float acc[kTok][kLanes];
    for (int64_t it = begin; it < end; ++it) {
      const ExpandItem item = expand[it];
      const int64_t col_end = std::min(item.first_col + kItemCols, offsets[item.part + 1]);
      const T* b_s = bs + item.slot * rank * n_out;
      const int64_t first = starts[item.slot], count = counts[item.slot];
      for (int64_t t0 = 0; t0 < count; t0 += kTok) {
        const int64_t nt = std::min(kTok, count - t0);
        const float* xrows[kTok];
        T* orows[kTok];
        for (int64_t m = 0; m < nt; ++m) {
          xrows[m] = xa.data() + (first + t0 + m) * width + item.part * rank;
          orows[m] = os + static_cast<int64_t>(sorted[first + t0 + m]) * out_ld;
        }
        for (int64_t c = item.first_col; c < col_end; c += kLanes) {
          const int64_t cw = std::min(kLanes, col_end - c);
          for (int64_t m = 0; m < nt; ++m)
            for (int64_t l = 0; l < kLanes; ++l) acc[m][l] = 0.f;
          axpys_any<T>(xrows, nt, b_s + c, n_out, rank, cw, acc);
          for (int64_t m = 0; m < nt; ++m)
            for (int64_t l = 0; l < cw; ++l) orows[m][c + l] = static_cast<T>(as_float(orows[m][c + l]) + acc[m][l]);
        }
      }
    }
  });
}

}  // namespace

void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const std::vector<int64_t>& offsets, const at::Tensor& sorted, const at::Tensor& counts,
               const at::Tensor& starts) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "lora_add_: x must be [T, in] on CPU, unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "lora_add_: float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.scalar_type() == x.scalar_type(),
              "lora_add_: out must be [T, N] in x's dtype, unit column stride");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() &&
                  a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
              "lora_add_: a [S, W, in] and b [S, R, N], contiguous, in x's dtype");
  const int64_t parts = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK(parts >= 1 && offsets[0] == 0 && offsets[parts] == out.size(1) && b.size(2) == out.size(1),
              "lora_add_: offsets must run from 0 to out's columns");
  for (int64_t p = 0; p < parts; ++p) TORCH_CHECK(offsets[p] <= offsets[p + 1], "lora_add_: offsets must ascend");
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == x.size(1) && a.size(1) == parts * b.size(1),
              "lora_add_: a's rows must be one rank block per sub-projection, a's columns x's");
  for (const auto* t : {&sorted, &counts, &starts})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
                "lora_add_: sorted, counts and starts must be contiguous int32 CPU vectors");
  const int64_t used = counts.size(0);
  TORCH_CHECK(starts.size(0) == used && used <= a.size(0), "lora_add_: counts and starts cover the slots in use");
  const int32_t* cs = counts.data_ptr<int32_t>();
  const int32_t* ss = starts.data_ptr<int32_t>();
  const int32_t* srt = sorted.data_ptr<int32_t>();
  for (int64_t s = 0; s < used; ++s) {
    TORCH_CHECK(cs[s] >= 0 && ss[s] >= 0 && ss[s] + cs[s] <= sorted.size(0), "lora_add_: a slot's tokens overrun sorted");
    for (int64_t i = ss[s]; i < ss[s] + cs[s]; ++i)
      TORCH_CHECK(srt[i] >= 0 && srt[i] < x.size(0), "lora_add_: token index out of range");
  }
  if (x.scalar_type() == at::kFloat)
    run<float>(x, out, a, b, offsets, srt, cs, ss, used);
  else
    run<at::BFloat16>(x, out, a, b, offsets, srt, cs, ss, used);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add_", &lora_add_, "multi-LoRA deltas added in place, for few tokens per adapter");
}
