// Fused small ops of a CPU decoder layer, each one pass over its rows on torch's intra-op pool:
// the residual add + RMSNorm (in place, vLLM's fused_add_rms_norm), SiLU-and-mul and the rotary
// embedding of q and k (in place). float32 and bfloat16; the arithmetic is in float32 and each output is
// rounded to the model dtype once. The torch paths in engine_svc/model/layers/{norm,activation,rotary}.py
// compute the same (the reference).
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
void add_rms_norm_kernel(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  T* xs = x.data_ptr<T>();
  T* rs = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* xr = xs + row * dim;
      T* rr = rs + row * dim;
      float ss = 0.f;
      // the new residual is rounded to the model dtype first (as torch's x + residual is), and the
      // statistics are taken over the rounded values
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) {
        const float sum = tandem::round_to<T>(tandem::as_float(xr[d]) + tandem::as_float(rr[d]));
        rr[d] = tandem::from_float<T>(sum);  // exact: `sum` is already a T value
        ss += sum * sum;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + feps);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d)
        xr[d] = tandem::from_float<T>(tandem::as_float(rr[d]) * inv * tandem::as_float(w[d]));
    }
  });
}

template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), half = out.size(1);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = xs + row * 2 * half;
      const T* up = gate + half;
      T* o = os + row * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float g = tandem::as_float(gate[i]);
        o[i] = tandem::from_float<T>(g / (1.f + tandem::exp_clamped(-g)) * tandem::as_float(up[i]));
      }
    }
  });
}

// x[t, h] <- x[t, h] * cos + rotate_half(x[t, h]) * sin at position positions[t]; the cache row holds
// cos and the signed sine [-sin, sin] over the whole head (engine_svc/model/layers/rotary.py).
template <typename T>
void rotary_kernel(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* xs = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cs = cache.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cos_sin(2 * dim);  // the token's cache row in float32: cos [0, D), signed sin [D, 2D)
    const float* cos = cos_sin.data();
    const float* sin = cos + dim;
    for (int64_t t = begin; t < end; ++t) {
      const T* src = cs + pos[t] * 2 * dim;
#pragma omp simd
      for (int64_t d = 0; d < 2 * dim; ++d) cos_sin[d] = tandem::as_float(src[d]);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xs + t * token_stride + h * head_stride;
        // iteration d reads and writes only row[d] and row[d + half]: no dependence between iterations
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float lo = tandem::as_float(row[d]), hi = tandem::as_float(row[d + half]);
          row[d] = tandem::from_float<T>(lo * cos[d] + hi * sin[d]);
          row[d + half] = tandem::from_float<T>(hi * cos[d + half] + lo * sin[d + half]);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), what, ": a contiguous 2-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
}

}  // namespace

// x, residual [T, D] (same dtype, contiguous), weight [D]: residual <- x + residual,
// x <- rms_norm(residual) * weight, both in place.
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_ x");
  check_rows(residual, "add_rms_norm_ residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "add_rms_norm_: weight must be [D] in x's dtype");
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_kernel<float>(x, residual, weight, eps);
  } else {
    add_rms_norm_kernel<at::BFloat16>(x, residual, weight, eps);
  }
}

// x [T, 2I] = [gate | up] (contiguous) -> silu(gate) * up, [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_kernel<float>(x, out);
  } else {
    silu_and_mul_kernel<at::BFloat16>(x, out);
  }
  return out;
}

// x [T, H, D] (any token / head strides, dense rows: a view of the qkv projection), positions [T] int64,
// cache [P, 2, D] (cos, signed sin) in x's dtype: x rotated in place.
void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cache) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be a CPU [T, H, D] tensor with dense rows of even D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary_: float32 or bfloat16");
  TORCH_CHECK(cache.dim() == 3 && cache.size(1) == 2 && cache.size(2) == x.size(2) && cache.is_contiguous() &&
                  cache.scalar_type() == x.scalar_type(),
              "rotary_: cache must be [P, 2, D] in x's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.size(0) == x.size(0),
              "rotary_: positions must be [T] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cache.size(0), "rotary_: position out of the cache");
  if (x.scalar_type() == at::kFloat) {
    rotary_kernel<float>(x, positions, cache);
  } else {
    rotary_kernel<at::BFloat16>(x, positions, cache);
  }
}
