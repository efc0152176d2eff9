// The GatedDeltaNet recurrence of decode steps and verify windows, as an MLX custom
// primitive on CPU.
//
// mlx-lm's step (`_gated_delta_step_ops`), per (sequence, value head, row dv of the
// state [Dv, Dk]) and token:
//
//   s      = state * g                      (decay)
//   kv     = sum_i s[i] * k[i]               (ascending i, from 0)
//   delta  = (v[dv] - kv) * beta
//   state  = s + k * delta
//   y[dv]  = sum_i state[i] * q[i]           (ascending i, from 0)
//
// On CPU MLX computes that as 5-8 passes over the 1 MB state of a Qwen3.5-0.8B layer
// (0.65 ms a layer a token here, measured), and a T-token verify window stepping token
// by token costs T times that. Here the state is read once, kept in L1 for all T tokens
// of the window, and written once per position kept.
//
// Bits: MLX's CPU reductions on x86 add in ascending order from 0 (scalar SIMD width)
// and its compiled kernels do not fuse multiply-adds, so every value above is computed
// as one rounded multiply and one rounded add in that order; eight rows dv go in the
// eight lanes of a vector, so each lane is the scalar chain. The result is bit-identical
// to mlx-lm's ops (tests/test_gated_delta_native.py), for any T, batch or thread split:
// a verify window's positions get the bits of plain steps.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

using ParallelFn = void (*)(int parts, const std::function<void(int, int)>& fn);

namespace gdn {

#include "qmm_common.h"

ParallelFn parallel = nullptr;
long thread_min = 1L << 17;  // state entries x tokens below which one thread computes

struct Job {
  const float *q, *k, *v, *g, *beta;  // q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]
  const float* state;                 // [B, Hv, Dv, Dk]
  const bool* mask;                   // [B, T] or null
  float* y;                           // [B, T, Hv, Dv]
  std::vector<float*> states;         // one [B, Hv, Dv, Dk] per kept position (the last, or all T)
  long B, T, Hk, Hv, Dk, Dv;
};

// 8x8 transpose of r[0..8) in place (rows <-> lanes).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Rows r0..r0+8 of state [Dv, Dk] at `src` -> s[i] = lanes (row r0+j, column i).
inline void load_rows(const float* src, long Dk, float* s) {
  for (long i = 0; i < Dk; i += 8) {
    __m256 r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + j * Dk + i);
    transpose8(r);
    for (int j = 0; j < 8; j++) _mm256_store_ps(s + (i + j) * 8, r[j]);
  }
}

inline void store_rows(const float* s, long Dk, float* dst) {
  for (long i = 0; i < Dk; i += 8) {
    __m256 r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_load_ps(s + (i + j) * 8);
    transpose8(r);
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + j * Dk + i, r[j]);
  }
}

// One token on the block's 8 rows: s (Dk vectors of 8 rows) updated in place, y's 8 values returned.
inline __m256 step(float* s, const float* q, const float* k, __m256 v, float g, float beta, long Dk) {
  const __m256 gv = _mm256_set1_ps(g);
  __m256 kv = _mm256_setzero_ps();
  for (long i = 0; i < Dk; i++) {
    const __m256 si = _mm256_mul_ps(_mm256_load_ps(s + i * 8), gv);
    _mm256_store_ps(s + i * 8, si);
    kv = _mm256_add_ps(kv, _mm256_mul_ps(si, _mm256_set1_ps(k[i])));
  }
  const __m256 delta = _mm256_mul_ps(_mm256_sub_ps(v, kv), _mm256_set1_ps(beta));
  __m256 y = _mm256_setzero_ps();
  for (long i = 0; i < Dk; i++) {
    const __m256 si = _mm256_add_ps(_mm256_load_ps(s + i * 8), _mm256_mul_ps(_mm256_set1_ps(k[i]), delta));
    _mm256_store_ps(s + i * 8, si);
    y = _mm256_add_ps(y, _mm256_mul_ps(si, _mm256_set1_ps(q[i])));
  }
  return y;
}

// Sequence b, value head h, state rows [r0, r0 + 8), all T tokens.
void block(const Job& jb, long b, long h, long r0, float* s, float* spare) {
  const long hk = h / (jb.Hv / jb.Hk);
  const size_t base = (size_t(b * jb.Hv + h) * jb.Dv + r0) * jb.Dk;
  load_rows(jb.state + base, jb.Dk, s);
  const long kept0 = jb.T - long(jb.states.size());  // first position whose state is an output
  for (long t = 0; t < jb.T; t++) {
    const size_t bt = size_t(b * jb.T + t);
    const float* q = jb.q + (bt * jb.Hk + hk) * jb.Dk;
    const float* k = jb.k + (bt * jb.Hk + hk) * jb.Dk;
    const __m256 v = _mm256_loadu_ps(jb.v + (bt * jb.Hv + h) * jb.Dv + r0);
    const float g = jb.g[bt * jb.Hv + h], beta = jb.beta[bt * jb.Hv + h];
    // A masked position leaves the state as it was; its y is still the updated state's (as mlx-lm's).
    const bool keep = jb.mask == nullptr || jb.mask[bt];
    float* cur = s;
    if (!keep) {
      std::memcpy(spare, s, sizeof(float) * 8 * jb.Dk);
      cur = spare;
    }
    _mm256_storeu_ps(jb.y + (bt * jb.Hv + h) * jb.Dv + r0, step(cur, q, k, v, g, beta, jb.Dk));
    if (t >= kept0) store_rows(s, jb.Dk, jb.states[t - kept0] + base);
  }
}

class GatedDeltaSteps : public mx::Primitive {
 public:
  GatedDeltaSteps(mx::Stream s, bool all_states, bool masked)
      : mx::Primitive(s), all_states_(all_states), masked_(masked) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = claim_outputs(stream(), inputs, outputs);
    const auto& q = inputs[0];
    const auto& v = inputs[2];
    Job jb{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
           outputs[0].data<float>(), {}, q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3)};
    for (size_t i = 1; i < outputs.size(); i++) jb.states.push_back(outputs[i].data<float>());
    std::vector<RowMajor> in(inputs.begin(), inputs.end());
    enc.dispatch([jb, in = std::move(in), masked = masked_]() mutable {
      jb.q = in[0].get<float>(), jb.k = in[1].get<float>(), jb.v = in[2].get<float>(), jb.g = in[3].get<float>();
      jb.beta = in[4].get<float>(), jb.state = in[5].get<float>(), jb.mask = masked ? in[6].get<bool>() : nullptr;
      const long blocks = jb.Dv / 8, tasks = jb.B * jb.Hv * blocks;
      auto part = [&](int p, int parts) {
        Aligned64<float> buf;
        float* s = buf.reserve(size_t(16) * jb.Dk);
        for (long t = tasks * p / parts; t < tasks * (p + 1) / parts; t++) {
          const long bh = t / blocks;
          block(jb, bh / jb.Hv, bh % jb.Hv, (t % blocks) * 8, s, s + 8 * jb.Dk);
        }
      };
      const long work = jb.B * jb.Hv * jb.Dv * jb.Dk * jb.T;
      if (parallel == nullptr || work < thread_min || tasks < 2) part(0, 1);
      else parallel(int(std::min<long>(tasks, 64)), part);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtp gated delta: CPU only");
  }

  const char* name() const override { return "MtpGatedDeltaSteps"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatedDeltaSteps&>(other);
    return all_states_ == o.all_states_ && masked_ == o.masked_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& v = inputs[2];
    std::vector<mx::Shape> shapes = {v.shape()};
    const int kept = all_states_ ? v.shape(1) : 1;
    for (int i = 0; i < kept; i++) shapes.push_back(inputs[5].shape());
    return shapes;
  }

 private:
  bool all_states_, masked_;
};

// q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk]; mask [B, T] bool or None;
// all float32 -> [y [B, T, Hv, Dv], the state after each position (all_states) or after the last].
std::vector<mx::array> gated_delta_steps(const mx::array& q, const mx::array& k, const mx::array& v,
                                         const mx::array& g, const mx::array& beta, const mx::array& state,
                                         std::optional<mx::array> mask, bool all_states) {
  for (const auto* a : {&q, &k, &v, &g, &beta, &state})
    if (a->dtype() != mx::float32) throw std::invalid_argument("mtp gated delta: inputs must be float32");
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4 || v.shape(0) != q.shape(0) || v.shape(1) != q.shape(1))
    throw std::invalid_argument("mtp gated delta: q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]");
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3), Hv = v.shape(2), Dv = v.shape(3);
  if (T < 1 || Hv % Hk != 0 || Dk % 8 != 0 || Dv % 8 != 0)
    throw std::invalid_argument("mtp gated delta: heads or head dims not supported");
  if (g.shape() != mx::Shape{B, T, Hv} || beta.shape() != g.shape() || state.shape() != mx::Shape{B, Hv, Dv, Dk})
    throw std::invalid_argument("mtp gated delta: g, beta [B, T, Hv] and state [B, Hv, Dv, Dk]");
  if (mask && (mask->dtype() != mx::bool_ || mask->shape() != mx::Shape{B, T}))
    throw std::invalid_argument("mtp gated delta: mask [B, T] bool");
  auto s = mx::to_stream({});
  std::vector<mx::array> in = {q, k, v, g, beta, state};
  if (mask) in.push_back(*mask);
  std::vector<mx::Shape> shapes = {v.shape()};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (int i = 0; i < (all_states ? T : 1); i++) {
    shapes.push_back(state.shape());
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<GatedDeltaSteps>(s, all_states, bool(mask)), std::move(in));
}

}  // namespace gdn

// Called from quantized_matmul.cpp's module definition, with its thread pool.
void register_gated_delta(nb::module_& m, ParallelFn run) {
  gdn::parallel = run;
  m.def("gated_delta_steps", &gdn::gated_delta_steps, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a, "state"_a,
        "mask"_a = nb::none(), "all_states"_a = false);
  m.def("set_gated_delta_thread_min", [](long n) { gdn::thread_min = n; });
}
