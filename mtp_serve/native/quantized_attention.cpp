// Attention's value product over a quantized KV cache (--kv-bits), as an MLX
// custom primitive on CPU.
//
// For decode steps and verify windows the attention probabilities p [rows, S]
// meet the cached values V [S, D], quantized in groups along D (mlx-lm's
// QuantizedKVCache layout: packed [S, D*bits/32], scales and biases [S, D/gs]):
//
//   out[m, d] = sum_s p[m, s] * (scale[s, g(d)] * q[s, d] + bias[s, g(d)])
//
// MLX 0.32's CPU `quantized_matmul(p, V, transpose=False)` dequantizes V for each
// row of p, so a 4-query window costs about 4 single queries. Here a tile of V is
// unpacked to float once (v = q * scale + bias, one FMA) and then costs one FMA
// per row of p. The scores (q @ K^T) need no new code: K's groups lie along the
// reduced dimension, so they are quantized_matmul.cpp's gathered product with
// one "expert" per (sequence, kv head).
//
// Exactness across row counts: out[m, d] is one FMA chain over s in ascending
// order, whatever the rows beside m, the blocking over rows, or the split over
// threads (tasks are (head, 64 columns of D) and never split s), so a verify
// window's rows get the bits T single steps would.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

// quantized_matmul.cpp's thread pool: fn(part, parts) on up to `parts` threads.
using ParallelFn = void (*)(int parts, const std::function<void(int, int)>& fn);

namespace qattn {

#include "qmm_common.h"

constexpr int DC = 64;  // columns of D per task: a 64-byte line of 8-bit values, used whole
constexpr int SB = 64;  // keys unpacked per tile (64 x 64 floats: 16 KB, in L1)
constexpr int MB = 4;   // rows of p per register block
constexpr int SUB = 16;  // columns per register block (two 8-lane vectors)

// 8 values of one key's packed row `w`, columns d0..d0+7, as floats.
template <int BITS>
inline __m256 unpack8(const uint32_t* w, int d0) {
  if constexpr (BITS == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(w) + d0));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else {  // 4 bits: 8 nibbles of one word, element i at bits 4i
    const __m256i v = _mm256_set1_epi32(int(w[d0 / 8]));
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(0xF)));
  }
}

struct ValueJob {
  const float* p;  // [E * M, S]
  const uint32_t* w;  // [E, Sbuf, D*bits/32]
  const void* scales;  // [E, Sbuf, D/gs]
  const void* biases;
  float* out;  // [E * M, D]
  long M, S, Sbuf, D;
  int gs;
};

// acc[m, 0..16) += sum over the tile's n keys of p[m, s] * tile[s, c..c+16), for rows m0..m0+R.
template <int R>
inline __attribute__((always_inline)) void accumulate(const ValueJob& jb, long e, long m0, long s0, int n,
                                                      const float* tile, int c, float* acc) {
  const float* pr[R];
  __m256 a0[R], a1[R];
  for (int i = 0; i < R; i++) {
    pr[i] = jb.p + size_t(e * jb.M + m0 + i) * jb.S + s0;
    a0[i] = _mm256_loadu_ps(acc + (m0 + i) * DC + c);
    a1[i] = _mm256_loadu_ps(acc + (m0 + i) * DC + c + 8);
  }
  for (int s = 0; s < n; s++) {
    const __m256 v0 = _mm256_load_ps(tile + s * DC + c), v1 = _mm256_load_ps(tile + s * DC + c + 8);
    for (int i = 0; i < R; i++) {
      const __m256 pb = _mm256_broadcast_ss(pr[i] + s);
      a0[i] = _mm256_fmadd_ps(pb, v0, a0[i]);
      a1[i] = _mm256_fmadd_ps(pb, v1, a1[i]);
    }
  }
  for (int i = 0; i < R; i++) {
    _mm256_storeu_ps(acc + (m0 + i) * DC + c, a0[i]);
    _mm256_storeu_ps(acc + (m0 + i) * DC + c + 8, a1[i]);
  }
}

// Rows e*M .. e*M+M-1 of out, columns [d0, d0 + DC).
template <int BITS, int ST>
void value_task(const ValueJob& jb, long e, int d0) {
  const long Dw = jb.D * BITS / 32, G = jb.D / jb.gs;
  const uint32_t* w = jb.w + size_t(e) * jb.Sbuf * Dw;
  const long sg0 = e * jb.Sbuf * G;
  std::vector<float> acc(size_t(jb.M) * DC, 0.0f);
  alignas(32) float tile[SB * DC];
  for (long s0 = 0; s0 < jb.S; s0 += SB) {
    const int n = int(std::min<long>(SB, jb.S - s0));
    for (int s = 0; s < n; s++) {  // v = q * scale + bias, once per entry
      const long row = s0 + s;
      const uint32_t* wr = w + size_t(row) * Dw;
      for (int c = 0; c < DC; c += 8) {
        const long g = (d0 + c) / jb.gs;
        const __m256 sc = _mm256_set1_ps(ld1<ST>(jb.scales, sg0 + row * G + g));
        const __m256 bi = _mm256_set1_ps(ld1<ST>(jb.biases, sg0 + row * G + g));
        _mm256_store_ps(tile + s * DC + c, _mm256_fmadd_ps(unpack8<BITS>(wr, d0 + c), sc, bi));
      }
    }
    for (int c = 0; c < DC; c += SUB) {
      long m = 0;
      for (; m + MB <= jb.M; m += MB) accumulate<MB>(jb, e, m, s0, n, tile, c, acc.data());
      for (; m < jb.M; m++) accumulate<1>(jb, e, m, s0, n, tile, c, acc.data());  // the same chain per row
    }
  }
  for (long m = 0; m < jb.M; m++)
    std::memcpy(jb.out + size_t(e * jb.M + m) * jb.D + d0, acc.data() + m * DC, DC * sizeof(float));
}

using TaskFn = void (*)(const ValueJob&, long, int);

template <int BITS>
TaskFn pick_st(int st) {
  if (st == F32) return value_task<BITS, F32>;
  if (st == BF16) return value_task<BITS, BF16>;
  return value_task<BITS, F16>;
}

ParallelFn parallel = nullptr;
long thread_min = 1L << 18;  // multiply-adds below which one thread computes

class QuantizedValueRows : public mx::UnaryPrimitive {
 public:
  QuantizedValueRows(mx::Stream s, int group_size, int bits, long rows_per_head)
      : mx::UnaryPrimitive(s), gs_(group_size), bits_(bits), M_(rows_per_head) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& p = inputs[0];
    const auto& w = inputs[1];
    const auto& sc = inputs[2];
    const auto& bi = inputs[3];
    auto& enc = claim_output(stream(), inputs, out);
    const int st = scale_type(sc.dtype());
    ValueJob jb{nullptr, nullptr, nullptr, nullptr, out.data<float>(),
                M_, p.shape(-1), w.shape(1), long(w.shape(2)) * 32 / bits_, gs_};
    const TaskFn fn = bits_ == 8 ? pick_st<8>(st) : pick_st<4>(st);
    const long E = w.shape(0);
    enc.dispatch([jb, fn, E, rp = RowMajor(p), rw = RowMajor(w), rs = RowMajor(sc), rb = RowMajor(bi)]() mutable {
      jb.p = rp.get<float>(), jb.w = rw.get<uint32_t>(), jb.scales = rs.get<char>(), jb.biases = rb.get<char>();
      const long chunks = jb.D / DC, tasks = E * chunks;
      auto part = [&](int k, int parts) {
        for (long t = tasks * k / parts; t < tasks * (k + 1) / parts; t++) fn(jb, t / chunks, int(t % chunks) * DC);
      };
      const long work = E * jb.M * jb.S * jb.D;
      if (parallel == nullptr || work < thread_min || tasks < 2) part(0, 1);
      else parallel(int(std::min<long>(tasks, 64)), part);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp attention values: CPU only");
  }

  const char* name() const override { return "MtpQuantizedValueRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedValueRows&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && M_ == o.M_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape{inputs[0].shape(0), int(long(inputs[1].shape(2)) * 32 / bits_)}};
  }

 private:
  int gs_, bits_;
  long M_;
};

// p [E * rows_per_head, S] float32; w [E, Sbuf >= S, D*bits/32] uint32; scales, biases [E, Sbuf, D/gs]
// -> [E * rows_per_head, D] float32: p @ dequantize(w[:, :S]).
mx::array quantized_values(const mx::array& p, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int rows_per_head, int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("mtp attention values: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("mtp attention values: group_size must be 32, 64 or 128");
  if (p.dtype() != mx::float32 || p.ndim() != 2) throw std::invalid_argument("mtp attention values: p must be [rows, S] float32");
  if (w.dtype() != mx::uint32 || w.ndim() != 3) throw std::invalid_argument("mtp attention values: bad packed values");
  const long D = long(w.shape(2)) * 32 / bits;
  if (D % DC != 0 || D % group_size != 0) throw std::invalid_argument("mtp attention values: bad head dimension");
  if (scales.shape() != biases.shape() || scales.dtype() != biases.dtype() || scales.ndim() != 3 ||
      scales.shape(0) != w.shape(0) || scales.shape(1) != w.shape(1) || scales.shape(2) != D / group_size ||
      !(scales.dtype() == mx::float32 || scales.dtype() == mx::bfloat16 || scales.dtype() == mx::float16))
    throw std::invalid_argument("mtp attention values: scales/biases do not match the values");
  if (rows_per_head < 1 || long(p.shape(0)) != long(w.shape(0)) * rows_per_head || p.shape(1) > w.shape(1))
    throw std::invalid_argument("mtp attention values: p's rows or keys do not match the values");
  auto s = mx::to_stream({});
  std::vector<mx::array> in = {p, w, scales, biases};
  return mx::array(mx::Shape{p.shape(0), int(D)}, mx::float32,
                   std::make_shared<QuantizedValueRows>(s, group_size, bits, rows_per_head), std::move(in));
}

}  // namespace qattn

// Called from quantized_matmul.cpp's module definition, with its thread pool.
void register_attention(nb::module_& m, ParallelFn run) {
  qattn::parallel = run;
  m.def("quantized_values", &qattn::quantized_values, "p"_a, "w"_a, "scales"_a, "biases"_a, "rows_per_head"_a,
        "group_size"_a, "bits"_a);
}
