// The experts of a MoE layer on CPU for few rows per expert (decode): one pass over each chosen expert's
// weights, every (token, choice) row routed to it multiplied as the weights stream by.
//
// moe_experts(x [T, H], ids [T, K] int64, weights [T, K] float32, w13 [E, 2I, H], w2 [E, H, I], w13_bias?,
//             w2_bias?, activation, alpha, limit) -> [T, H]
//   ids < 0 are choices of experts another rank holds: they contribute nothing. The (token, choice) slots
//   are bucketed by expert here (a counting sort, stable); experts with no slot are never read.
// Numerics (kernels/fused_moe_ref.py): gate/up and down dot products in float32, each result rounded to
// the model dtype (a torch linear's output), the gated activation in float32 rounded once, the weighted sum
// over a token's choices in float32 in ascending expert order, rounded once.
// Work: phase 1 runs (expert, block of gate/up rows) items on torch's intra-op pool, the activation fused
// in (an item holds matching gate and up rows); phase 2 (expert, block of down rows), weighted; phase 3
// sums each token's rows. Where the build has AVX512-BF16, bfloat16 dot products use vdpbf16ps (products
// exact, sums float32, as the portable loop).
#include <torch/extension.h>

#include "cpu_math.h"

#include <ATen/Parallel.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TANDEM_MOE_AVX512_BF16 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using tandem::as_float;  // cpu_math.h
template <typename T>
inline float rounded(float x) {  // x rounded to T, back in float32
  return as_float(static_cast<T>(x));
}

enum Activation : int64_t { kSilu = 0, kSwigluOai = 1 };

constexpr int64_t kRows = 4;  // slot rows per register block
constexpr int64_t kCols = 4;  // weight rows per register block
constexpr int64_t kBlock = 32;  // weight rows per work item

// out[m][c] = rows[m] . w[c] over k in [0, n) for m < nm, c < nc (portable: the compiler vectorises).
template <typename T>
inline void dots(const T* const* rows, int64_t nm, const T* const* w, int64_t nc, int64_t n, float out[kRows][kCols]) {
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t m = 0; m < nm; ++m) {
      const T* a = rows[m];
      const T* b = w[c];
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < n; ++k) s += as_float(a[k]) * as_float(b[k]);
      out[m][c] = s;
    }
}

#ifdef TANDEM_MOE_AVX512_BF16
inline __m512bh load_bf16(const at::BFloat16* p, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), p);
}

// vdpbf16ps over 32 bfloat16 a step, NM x NC accumulators fixed at compile time so that they stay in
// registers; the next weight lines are prefetched a few steps ahead.
template <int NM, int NC>
inline void dots_bf16(const at::BFloat16* const* rows, const at::BFloat16* const* w, int64_t n, float out[kRows][kCols]) {
  __m512 acc[NM][NC];
  for (int m = 0; m < NM; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 32) {
    const int64_t left = n - k;
    __m512bh b[NC];
    for (int c = 0; c < NC; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w[c] + k + 256), _MM_HINT_T0);
      b[c] = load_bf16(w[c] + k, left);
    }
    for (int m = 0; m < NM; ++m) {
      const __m512bh a = load_bf16(rows[m] + k, left);
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], a, b[c]);
    }
  }
  for (int m = 0; m < NM; ++m)
    for (int c = 0; c < NC; ++c) out[m][c] = _mm512_reduce_add_ps(acc[m][c]);
}

template <int NM>
inline void dots_bf16_nc(const at::BFloat16* const* rows, const at::BFloat16* const* w, int64_t nc, int64_t n,
                         float out[kRows][kCols]) {
  switch (nc) {
    case 4: return dots_bf16<NM, 4>(rows, w, n, out);
    case 3: return dots_bf16<NM, 3>(rows, w, n, out);
    case 2: return dots_bf16<NM, 2>(rows, w, n, out);
    default: return dots_bf16<NM, 1>(rows, w, n, out);
  }
}

template <>
inline void dots<at::BFloat16>(const at::BFloat16* const* rows, int64_t nm, const at::BFloat16* const* w, int64_t nc,
                               int64_t n, float out[kRows][kCols]) {
  switch (nm) {
    case 4: return dots_bf16_nc<4>(rows, w, nc, n, out);
    case 3: return dots_bf16_nc<3>(rows, w, nc, n, out);
    case 2: return dots_bf16_nc<2>(rows, w, nc, n, out);
    default: return dots_bf16_nc<1>(rows, w, nc, n, out);
  }
}
#endif

template <typename T>
inline float gated(float gate, float up, int64_t activation, float alpha, float limit) {
  if (activation == kSilu) return rounded<T>(gate / (1.f + std::exp(-gate))) * up;
  gate = std::min(gate, limit);
  up = std::min(std::max(up, -limit), limit);
  return (up + 1.f) * (gate / (1.f + std::exp(-gate * alpha)));
}

struct Item {
  int64_t expert, first_row;
};

template <typename T>
at::Tensor run(const at::Tensor& x, const int64_t* slots, const int64_t* offsets, int64_t num_experts,
               const float* slot_weights, int64_t top_k, const at::Tensor& w13, const at::Tensor& w2,
               const T* b13, const T* b2, int64_t activation, float alpha, float limit) {
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = w2.size(2);
  const int64_t num_sorted = offsets[num_experts];
  const T* xs = x.data_ptr<T>();
  const T* w13s = w13.data_ptr<T>();
  const T* w2s = w2.data_ptr<T>();
  at::Tensor act = at::empty({num_sorted, inter}, x.options());
  at::Tensor y = at::empty({num_sorted, hidden}, x.options().dtype(at::kFloat));
  T* acts = act.data_ptr<T>();
  float* ys = y.data_ptr<float>();

  auto items_over = [&](int64_t width) {
    std::vector<Item> items;
    for (int64_t e = 0; e < num_experts; ++e)
      if (offsets[e + 1] > offsets[e])
        for (int64_t r = 0; r < width; r += kBlock) items.push_back({e, r});
    return items;
  };

  // Phase 1: act[pos, i] = act(gate . x, up . x) for the block's rows i of gate and the same rows of up.
  const std::vector<Item> up_items = items_over(inter);
  at::parallel_for(0, static_cast<int64_t>(up_items.size()), 1, [&](int64_t begin, int64_t end) {
    float out_g[kRows][kCols], out_u[kRows][kCols];
    for (int64_t it = begin; it < end; ++it) {
      const Item item = up_items[it];
      const T* we = w13s + item.expert * 2 * inter * hidden;
      const int64_t row_end = std::min(item.first_row + kBlock, inter);
      for (int64_t p0 = offsets[item.expert]; p0 < offsets[item.expert + 1]; p0 += kRows) {
        const int64_t nm = std::min(kRows, offsets[item.expert + 1] - p0);
        const T* rows[kRows];
        for (int64_t m = 0; m < nm; ++m) rows[m] = xs + (slots[p0 + m] / top_k) * hidden;
        for (int64_t i0 = item.first_row; i0 < row_end; i0 += kCols) {
          const int64_t nc = std::min(kCols, row_end - i0);
          const T* g[kCols];
          const T* u[kCols];
          for (int64_t c = 0; c < nc; ++c) {
            g[c] = we + (i0 + c) * hidden;
            u[c] = we + (inter + i0 + c) * hidden;
          }
          dots<T>(rows, nm, g, nc, hidden, out_g);
          dots<T>(rows, nm, u, nc, hidden, out_u);
          for (int64_t m = 0; m < nm; ++m)
            for (int64_t c = 0; c < nc; ++c) {
              float gv = out_g[m][c], uv = out_u[m][c];
              if (b13 != nullptr) {
                gv += as_float(b13[item.expert * 2 * inter + i0 + c]);
                uv += as_float(b13[item.expert * 2 * inter + inter + i0 + c]);
              }
              acts[(p0 + m) * inter + i0 + c] =
                  static_cast<T>(gated<T>(rounded<T>(gv), rounded<T>(uv), activation, alpha, limit));
            }
        }
      }
    }
  });

  // Phase 2: y[pos, h] = weight * round(w2[h] . act[pos]) for the block's rows h of down.
  const std::vector<Item> down_items = items_over(hidden);
  at::parallel_for(0, static_cast<int64_t>(down_items.size()), 1, [&](int64_t begin, int64_t end) {
    float out[kRows][kCols];
    for (int64_t it = begin; it < end; ++it) {
      const Item item = down_items[it];
      const T* we = w2s + item.expert * hidden * inter;
      const int64_t row_end = std::min(item.first_row + kBlock, hidden);
      for (int64_t p0 = offsets[item.expert]; p0 < offsets[item.expert + 1]; p0 += kRows) {
        const int64_t nm = std::min(kRows, offsets[item.expert + 1] - p0);
        const T* rows[kRows];
        for (int64_t m = 0; m < nm; ++m) rows[m] = acts + (p0 + m) * inter;
        for (int64_t h0 = item.first_row; h0 < row_end; h0 += kCols) {
          const int64_t nc = std::min(kCols, row_end - h0);
          const T* d[kCols];
          for (int64_t c = 0; c < nc; ++c) d[c] = we + (h0 + c) * inter;
          dots<T>(rows, nm, d, nc, inter, out);
          for (int64_t m = 0; m < nm; ++m) {
            const float weight = slot_weights[slots[p0 + m]];
            for (int64_t c = 0; c < nc; ++c) {
              float v = out[m][c];
              if (b2 != nullptr) v += as_float(b2[item.expert * hidden + h0 + c]);
              ys[(p0 + m) * hidden + h0 + c] = rounded<T>(v) * weight;
            }
          }
        }
      }
    }
  });

  // Phase 3: out[t] = sum of its rows, in sorted (ascending expert) order.
  std::vector<int64_t> position(tokens * top_k, -1);
  for (int64_t p = 0; p < num_sorted; ++p) position[slots[p]] = p;
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  T* os = out.data_ptr<T>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine;
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      mine.clear();
      for (int64_t k = 0; k < top_k; ++k)
        if (position[t * top_k + k] >= 0) mine.push_back(position[t * top_k + k]);
      std::sort(mine.begin(), mine.end());
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t p : mine) {
        const float* row = ys + p * hidden;
#pragma omp simd
        for (int64_t h = 0; h < hidden; ++h) sum[h] += row[h];
      }
      for (int64_t h = 0; h < hidden; ++h) os[t * hidden + h] = static_cast<T>(sum[h]);
    }
  });
  return out;
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                       const at::Tensor& w2, const c10::optional<at::Tensor>& w13_bias,
                       const c10::optional<at::Tensor>& w2_bias, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "moe_experts: x must be [T, H] contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "moe_experts: float32 or bfloat16");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_experts: w13 [E, 2I, H] and w2 [E, H, I], contiguous, in x's dtype");
  const int64_t num_experts = w13.size(0);
  TORCH_CHECK(w13.size(2) == x.size(1) && w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2) &&
                  w2.size(0) == num_experts,
              "moe_experts: expert weight shapes do not match x");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.is_contiguous(),
              "moe_experts: ids must be [T, K] int64");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "moe_experts: weights must be [T, K] float32");
  TORCH_CHECK(activation == kSilu || activation == kSwigluOai, "moe_experts: activation 0 (silu) or 1 (swigluoai)");
  for (const auto* bias : {&w13_bias, &w2_bias})
    TORCH_CHECK(!bias->has_value() || ((*bias)->is_contiguous() && (*bias)->scalar_type() == x.scalar_type()),
                "moe_experts: biases contiguous, in x's dtype");
  // Counting sort of the slots by expert.
  const int64_t num_slots = ids.numel(), top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(num_experts + 1, 0), slots;
  for (int64_t s = 0; s < num_slots; ++s) {
    TORCH_CHECK(id[s] < num_experts, "moe_experts: expert id out of range");
    if (id[s] >= 0) ++offsets[id[s] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  slots.resize(offsets[num_experts]);
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s)
    if (id[s] >= 0) slots[fill[id[s]]++] = s;
  if (x.scalar_type() == at::kFloat) {
    return run<float>(x, slots.data(), offsets.data(), num_experts, weights.data_ptr<float>(), top_k, w13, w2,
                      w13_bias ? w13_bias->data_ptr<float>() : nullptr, w2_bias ? w2_bias->data_ptr<float>() : nullptr,
                      activation, static_cast<float>(alpha), static_cast<float>(limit));
  }
  using B = at::BFloat16;
  return run<B>(x, slots.data(), offsets.data(), num_experts, weights.data_ptr<float>(), top_k, w13, w2,
                w13_bias ? w13_bias->data_ptr<B>() : nullptr, w2_bias ? w2_bias->data_ptr<B>() : nullptr, activation,
                static_cast<float>(alpha), static_cast<float>(limit));
}

bool has_avx512_bf16() {
#ifdef TANDEM_MOE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "a MoE layer's experts for few rows per expert");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether bfloat16 dot products use AVX512-BF16");
}
