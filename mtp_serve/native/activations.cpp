// Sigmoid, SiLU and SwiGLU for decode steps and verify windows, as MLX custom primitives
// on CPU, with MLX's own bits; below them RMS norm, the GatedDeltaNet decode conv
// + SiLU and RoPE, each one node in place of MLX's fallback graph.
//
// MLX's CPU sigmoid is 1 / (1 + exp(|x|)) (or 1 minus it) with its Cephes-style exp
// (simd/math.h), computed one element at a time on x86 (SIMD width 1): 13-19 ns an
// element here, measured, so the activations of a Qwen3.5-0.8B-shaped decode step
// (about 250k elements a token: the conv's SiLU, the gated norm's, the MLPs') cost about
// 3.5 ms a token, a sixth of a 4-token verify window. Here the same operations run eight
// lanes at a time, each one the scalar operation MLX performs, in its precision: the
// product by log2(e) in float, `floor(x + 0.5)` in double (the literal 0.5 is a double
// there), the polynomial with correctly rounded fused multiply-adds (std::fma), the
// exponent by integer shift, IEEE division. The results are bit-identical to
// `mx.sigmoid`, `nn.silu` and mlx-lm's `swiglu`, compiled or not (tests/test_activations_native.py).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace act {

#include "qmm_common.h"

// floor(x + 0.5) with the sum and floor in double, as MLX's `floor(x + 0.5)` on Simd<float, 1>.
inline __m256 floor_half_up(__m256 x) {
  const __m256d h = _mm256_set1_pd(0.5);
  const __m128 lo = _mm256_cvtpd_ps(_mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), h)));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), h)));
  return _mm256_set_m128(hi, lo);
}

// MLX's simd::exp (mlx/backend/cpu/simd/math.h), eight lanes.
inline __m256 exp_mlx(__m256 x_init) {
  const __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256 ipart = floor_half_up(x);
  const __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.0f));
  const __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  r = _mm256_blendv_ps(r, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

// MLX's Sigmoid (unary_ops.h): y = 1 / (1 + exp(|x|)); x < 0 ? y : 1 - y.
inline __m256 sigmoid_mlx(__m256 x) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp_mlx(ax)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

enum Op { SIGMOID = 0, SILU = 1, SWIGLU = 2 };

// out[i] for i in [0, n): sigmoid(a), a * sigmoid(a) (nn.silu), or silu(a) * b (mlx-lm's swiglu).
template <int OP>
void run(const float* a, const float* b, float* out, long n) {
  alignas(32) float ta[8] = {}, tb[8] = {}, to[8];
  auto lane8 = [](__m256 va, __m256 vb) {
    const __m256 s = sigmoid_mlx(va);
    if constexpr (OP == SIGMOID) return s;
    const __m256 silu = _mm256_mul_ps(va, s);
    if constexpr (OP == SILU) return silu;
    return _mm256_mul_ps(silu, vb);
  };
  long i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, lane8(_mm256_loadu_ps(a + i), OP == SWIGLU ? _mm256_loadu_ps(b + i) : _mm256_setzero_ps()));
  if (i < n) {  // the tail through a padded buffer (lanes are independent)
    for (long j = i; j < n; j++) ta[j - i] = a[j], tb[j - i] = OP == SWIGLU ? b[j] : 0.0f;
    _mm256_store_ps(to, lane8(_mm256_load_ps(ta), _mm256_load_ps(tb)));
    for (long j = i; j < n; j++) out[j] = to[j - i];
  }
}

class Activation : public mx::UnaryPrimitive {
 public:
  Activation(mx::Stream s, int op) : mx::UnaryPrimitive(s), op_(op) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = claim_output(stream(), inputs, out);
    float* o = out.data<float>();
    const long n = long(out.size());
    const int op = op_;
    enc.dispatch([ra = RowMajor(inputs[0]), rb = inputs.size() > 1 ? RowMajor(inputs[1]) : RowMajor(), o, n, op]() {
      const float* a = ra.get<float>();
      const float* b = op == SWIGLU ? rb.get<float>() : nullptr;
      if (op == SIGMOID) run<SIGMOID>(a, b, o, n);
      else if (op == SILU) run<SILU>(a, b, o, n);
      else run<SWIGLU>(a, b, o, n);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp activations: CPU only");
  }

  const char* name() const override { return "MtpActivation"; }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    return reference_vjp([op = op_](const std::vector<mx::array>& in) {
      auto silu = [](const mx::array& a) { return mx::multiply(a, mx::sigmoid(a)); };
      if (op == SIGMOID) return std::vector<mx::array>{mx::sigmoid(in[0])};
      if (op == SILU) return std::vector<mx::array>{silu(in[0])};
      return std::vector<mx::array>{mx::multiply(silu(in[0]), in[1])};
    }, primals.size(), primals, cotangents, argnums);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return op_ == static_cast<const Activation&>(other).op_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int op_;
};

mx::array activation(int op, const mx::array& a, const mx::array* b) {
  if (a.dtype() != mx::float32 || (b != nullptr && (b->dtype() != mx::float32 || b->shape() != a.shape())))
    throw std::invalid_argument("mtp activations: float32 inputs of one shape");
  auto s = mx::to_stream({});
  std::vector<mx::array> in = {a};
  if (b != nullptr) in.push_back(*b);
  return mx::array(a.shape(), mx::float32, std::make_shared<Activation>(s, op), std::move(in));
}

// ------------------------------------------------------------------ RMS norm

// mx.fast.rms_norm on CPU is its fallback graph, three nodes a call (Square, Sum, and a fused
// multiply-add-rsqrt-multiply), and a decode step makes ~115 calls (every layer's two norms,
// the GatedDeltaNet q/k normalization, the attention q/k norms). One node here, the same
// operations in the same order: each square rounded, summed from 0 in ascending order (MLX's
// CPU reduction on x86, SIMD width 1), times 1/N, plus eps, 1 / sqrt (IEEE, as MLX's rsqrt),
// then x * r, then * w, then * scale (mlx-lm's normalize_qk scales the normalized q and k).
void rms_rows(const float* x, const float* w, float* out, long rows, long n, float inv_n, float eps, float scale) {
  const bool scaled = scale != 1.0f;
  const __m256 vs = _mm256_set1_ps(scale);
  for (long r = 0; r < rows; r++) {
    const float* xr = x + r * n;
    float ss = 0.0f;
    for (long i = 0; i < n; i++) {
      const float sq = xr[i] * xr[i];
      ss = ss + sq;
    }
    const float t = ss * inv_n + eps;
    const float rs = 1.0f / std::sqrt(t);
    const __m256 vr = _mm256_set1_ps(rs);
    float* o = out + r * n;
    long i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 y = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vr);
      if (w != nullptr) y = _mm256_mul_ps(y, _mm256_loadu_ps(w + i));
      if (scaled) y = _mm256_mul_ps(y, vs);
      _mm256_storeu_ps(o + i, y);
    }
    for (; i < n; i++) {
      float y = xr[i] * rs;
      if (w != nullptr) y = y * w[i];
      o[i] = scaled ? y * scale : y;
    }
  }
}

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream s, float eps, float scale) : mx::UnaryPrimitive(s), eps_(eps), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = claim_output(stream(), inputs, out);
    const long n = out.shape(-1), rows = n ? long(out.size()) / n : 0;
    // MLX's mean multiplies by 1/N computed in double and rounded to float32.
    const float inv_n = float(1.0 / double(n)), eps = eps_, scale = scale_;
    enc.dispatch([rx = RowMajor(inputs[0]), rw = inputs.size() > 1 ? RowMajor(inputs[1]) : RowMajor(),
                  o = out.data<float>(), rows, n, inv_n, eps, scale, weighted = inputs.size() > 1]() {
      rms_rows(rx.get<float>(), weighted ? rw.get<float>() : nullptr, o, rows, n, inv_n, eps, scale);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp rms norm: CPU only");
  }

  const char* name() const override { return "MtpRMSNorm"; }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    return reference_vjp([eps = eps_, scale = scale_](const std::vector<mx::array>& in) {
      auto y = mx::fast::rms_norm(in[0], in.size() > 1 ? std::optional<mx::array>(in[1]) : std::nullopt, eps);
      return std::vector<mx::array>{scale != 1.0f ? mx::multiply(y, mx::array(scale)) : y};
    }, primals.size(), primals, cotangents, argnums);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_, scale_;
};

// x [..., N] float32, weight [N] float32 or None -> the bits of mx.fast.rms_norm(x, weight, eps) * scale
// (the product only where scale != 1).
mx::array rms_norm(const mx::array& x, std::optional<mx::array> weight, float eps, float scale) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 ||
      (weight && (weight->dtype() != mx::float32 || weight->ndim() != 1 || weight->shape(0) != x.shape(-1))))
    throw std::invalid_argument("mtp rms norm: float32 x [..., N] and weight [N]");
  auto s = mx::to_stream({});
  std::vector<mx::array> in = {x};
  if (weight) in.push_back(*weight);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(s, eps, scale), std::move(in));
}

// ------------------------------------------------------------------ depthwise conv + SiLU

// A GatedDeltaNet decode step's conv: out[b, s, c] = silu(sum_j x[b, s + j, c] * w[c, j]) over
// the K taps, as models/gdn.py's `_depthwise_conv` (products rounded, added from tap 0 up; MLX's
// compiled CPU kernels do not fuse multiply-adds) then `nn.silu` (this file's sigmoid). One node
// instead of the taps' slices of x and of the weight, the fused sum and the SiLU (14 a layer).
void conv_silu_rows(const float* x, const float* w, float* out, long B, long L, long C, long K) {
  const long S = L - K + 1;
  alignas(32) float tw[16][8];
  alignas(32) float tx[8], to[8];
  for (long c = 0; c < C; c += 8) {
    const long nc = std::min<long>(8, C - c);
    for (long j = 0; j < K; j++)
      for (long l = 0; l < 8; l++) tw[j][l] = l < nc ? w[(c + l) * K + j] : 0.0f;
    for (long b = 0; b < B; b++)
      for (long s0 = 0; s0 < S; s0++) {
        const float* xs = x + (b * L + s0) * C + c;
        auto load = [&](long j) {
          if (nc == 8) return _mm256_loadu_ps(xs + j * C);
          for (long l = 0; l < 8; l++) tx[l] = l < nc ? xs[j * C + l] : 0.0f;
          return _mm256_load_ps(tx);
        };
        __m256 acc = _mm256_mul_ps(load(0), _mm256_load_ps(tw[0]));
        for (long j = 1; j < K; j++) acc = _mm256_add_ps(acc, _mm256_mul_ps(load(j), _mm256_load_ps(tw[j])));
        const __m256 y = _mm256_mul_ps(acc, sigmoid_mlx(acc));
        float* o = out + (b * S + s0) * C + c;
        if (nc == 8) {
          _mm256_storeu_ps(o, y);
        } else {
          _mm256_store_ps(to, y);
          for (long l = 0; l < nc; l++) o[l] = to[l];
        }
      }
  }
}

class ConvSilu : public mx::UnaryPrimitive {
 public:
  explicit ConvSilu(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = claim_output(stream(), inputs, out);
    const auto& x = inputs[0];
    enc.dispatch([rx = RowMajor(x), rw = RowMajor(inputs[1]), o = out.data<float>(), B = long(x.shape(0)),
                  L = long(x.shape(1)), C = long(x.shape(2)), K = long(inputs[1].shape(1))]() {
      conv_silu_rows(rx.get<float>(), rw.get<float>(), o, B, L, C, K);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp conv silu: CPU only");
  }

  const char* name() const override { return "MtpConvSilu"; }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    return reference_vjp([](const std::vector<mx::array>& in) {
      const auto& x = in[0];
      const int B = x.shape(0), C = x.shape(2), K = in[1].shape(1), S = x.shape(1) - K + 1;
      std::optional<mx::array> acc;
      for (int j = 0; j < K; j++) {
        auto t = mx::multiply(mx::slice(x, {0, j, 0}, {B, j + S, C}),
                              mx::reshape(mx::slice(in[1], {0, j, 0}, {C, j + 1, 1}), {C}));
        acc = acc ? mx::add(*acc, t) : t;
      }
      return std::vector<mx::array>{mx::multiply(*acc, mx::sigmoid(*acc))};
    }, primals.size(), primals, cotangents, argnums);
  }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    return {mx::Shape{x.shape(0), x.shape(1) - inputs[1].shape(1) + 1, x.shape(2)}};
  }
};

// x [B, L, C], weight [C, K, 1] (mlx-lm's depthwise conv1d weight), float32, 1 <= K <= 16, L >= K.
mx::array conv_silu(const mx::array& x, const mx::array& weight) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() != 3 || weight.ndim() != 3 ||
      weight.shape(0) != x.shape(2) || weight.shape(2) != 1 || weight.shape(1) < 1 || weight.shape(1) > 16 ||
      x.shape(1) < weight.shape(1))
    throw std::invalid_argument("mtp conv silu: float32 x [B, L, C] and weight [C, K <= 16, 1] with L >= K");
  auto s = mx::to_stream({});
  return mx::array(mx::Shape{x.shape(0), x.shape(1) - weight.shape(1) + 1, x.shape(2)}, mx::float32,
                   std::make_shared<ConvSilu>(s), {x, weight});
}

// ------------------------------------------------------------------ RoPE

// mx.fast.rope on CPU is its fallback graph (positions, frequencies, cos, sin, the rotation, the
// concatenation: ~12 nodes a call, two calls an attention layer). One node here, the fallback's
// operations in its order, non-traditional forward with the default frequencies only:
//   position = (t + offset) * scale; inv_freq[i] = exp(-i * (log(base) / (dims / 2))) (MLX's exp);
//   theta = position * inv_freq; MLX's cos and sin (sincos_mlx);
//   out = [x1 cos - x2 sin, x1 sin + x2 cos, x[dims:]].
// MLX's sin / cos (simd/math.h: Cephes' sincos with correctly rounded fused multiply-adds; libm
// past 2^23), one value.
template <bool SINE>
float sincos_mlx(float in) {
  if (std::fabs(in) > 8388608.0f) return SINE ? std::sin(in) : std::cos(in);
  bool sign_sin = in < 0;
  float x = std::fabs(in);
  float y = x * 1.27323954473516f;
  uint32_t emm2 = static_cast<uint32_t>(y);
  emm2 = (emm2 + 1) & ~1u;
  y = static_cast<float>(emm2);
  const bool poly = (emm2 & 2) != 0;
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);
  sign_sin = sign_sin ^ ((emm2 & 4) != 0);
  const bool sign_cos = ((emm2 - 2) & 4) != 0;
  const float z = x * x;
  float y1 = std::fma(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float y2 = std::fma(z, -1.9515295891e-4f, 8.3321608736e-3f);
  y1 = std::fma(y1, z, 4.166664568298827e-2f);
  y2 = std::fma(y2, z, -1.6666654611e-1f);
  y1 = y1 * z;
  y2 = y2 * z;
  y1 = y1 * z;
  y2 = std::fma(x, y2, x);
  y1 = std::fma(z, -0.5f, y1);
  y1 = y1 + 1.0f;
  if constexpr (SINE) {
    const float ys = poly ? y1 : y2;
    return sign_sin ? -ys : ys;
  } else {
    const float yc = poly ? y2 : y1;
    return sign_cos ? yc : -yc;
  }
}

void rope_rows(const float* x, const int32_t* offsets, long n_offsets, float* out, long B, long H, long T, long D,
               long dims, float base, float scale) {
  const long half = dims / 2;
  const float c = std::log(base) / float(half);
  alignas(32) float ar[8], fr[8];
  std::vector<float> inv(half), cs(half), sn(half);
  for (long i = 0; i < half; i += 8) {  // MLX's exp, the one this file's sigmoid uses
    for (long l = 0; l < 8; l++) ar[l] = float(-(i + l)) * c;
    _mm256_store_ps(fr, exp_mlx(_mm256_load_ps(ar)));
    for (long l = 0; l < 8 && i + l < half; l++) inv[i + l] = fr[l];
  }
  for (long b = 0; b < B; b++)
    for (long t = 0; t < T; t++) {
      const float pos = (float(t) + float(offsets[n_offsets == 1 ? 0 : b])) * scale;
      for (long i = 0; i < half; i++) {
        const float theta = pos * inv[i];
        cs[i] = sincos_mlx<false>(theta), sn[i] = sincos_mlx<true>(theta);
      }
      for (long h = 0; h < H; h++) {
        const float* xr = x + ((b * H + h) * T + t) * D;
        float* o = out + ((b * H + h) * T + t) * D;
        for (long i = 0; i < half; i++) {
          const float x1 = xr[i], x2 = xr[half + i];
          const float a = x1 * cs[i], bb = x2 * sn[i], e = x1 * sn[i], f = x2 * cs[i];
          o[i] = a - bb;
          o[half + i] = e + f;
        }
        for (long i = dims; i < D; i++) o[i] = xr[i];
      }
    }
}

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream s, int dims, float base, float scale) : mx::UnaryPrimitive(s), dims_(dims), base_(base), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = claim_output(stream(), inputs, out);
    const auto& x = inputs[0];
    enc.dispatch([rx = RowMajor(x), ro = RowMajor(inputs[1]), no = long(inputs[1].size()), o = out.data<float>(),
                  B = long(x.shape(0)), H = long(x.shape(1)), T = long(x.shape(2)), D = long(x.shape(3)),
                  dims = long(dims_), base = base_, scale = scale_]() {
      rope_rows(rx.get<float>(), ro.get<int32_t>(), no, o, B, H, T, D, dims, base, scale);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp rope: CPU only");
  }

  const char* name() const override { return "MtpRope"; }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const auto offset = primals[1];
    return reference_vjp([offset, dims = dims_, base = base_, scale = scale_](const std::vector<mx::array>& in) {
      return std::vector<mx::array>{mx::fast::rope(in[0], dims, false, base, scale, offset)};
    }, 1, primals, cotangents, argnums);
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && base_ == o.base_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  float base_, scale_;
};

// x [B, H, T, D] float32, offset int32 [] / [1] / [B] -> mx.fast.rope(x, dims, traditional=False, base, scale, offset)'s bits.
mx::array rope(const mx::array& x, int dims, float base, float scale, const mx::array& offset) {
  if (x.dtype() != mx::float32 || x.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("mtp rope: float32 x [B, H, T, D] and even dims <= D");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && long(offset.size()) != x.shape(0)))
    throw std::invalid_argument("mtp rope: offset int32, one or one per row");
  auto s = mx::to_stream({});
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, base, scale), {x, offset});
}

}  // namespace act

// Called from quantized_matmul.cpp's module definition.
void register_activations(nb::module_& m) {
  m.def("sigmoid", [](const mx::array& x) { return act::activation(act::SIGMOID, x, nullptr); }, "x"_a);
  m.def("silu", [](const mx::array& x) { return act::activation(act::SILU, x, nullptr); }, "x"_a);
  m.def("swiglu", [](const mx::array& gate, const mx::array& x) { return act::activation(act::SWIGLU, gate, &x); },
        "gate"_a, "x"_a);
  m.def("rms_norm", &act::rms_norm, "x"_a, "weight"_a.none(), "eps"_a, "scale"_a = 1.0f);
  m.def("conv_silu", &act::conv_silu, "x"_a, "weight"_a);
  m.def("rope", &act::rope, "x"_a, "dims"_a, "base"_a, "scale"_a, "offset"_a);
}
