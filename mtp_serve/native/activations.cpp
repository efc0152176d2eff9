// Sigmoid, SiLU and SwiGLU for decode steps and verify windows, as MLX custom primitives
// on CPU, with MLX's own bits (issue 23).
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <nanobind/nanobind.h>

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

}  // namespace act

// Called from quantized_matmul.cpp's module definition.
void register_activations(nb::module_& m) {
  m.def("sigmoid", [](const mx::array& x) { return act::activation(act::SIGMOID, x, nullptr); }, "x"_a);
  m.def("silu", [](const mx::array& x) { return act::activation(act::SILU, x, nullptr); }, "x"_a);
  m.def("swiglu", [](const mx::array& gate, const mx::array& x) { return act::activation(act::SWIGLU, gate, &x); },
        "gate"_a, "x"_a);
}
