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
#include <limits>
#include <optional>
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


// ------------------------------------------------------------------ whole attention
//
// Decode steps and verify windows, full-precision or quantized KV, as one primitive.
// MLX 0.32's CPU `scaled_dot_product_attention` falls back to a graph of matmuls, a
// softmax and, for a window, a materialised causal mask: at 22k keys (the demo model's
// shapes, T=1) its p @ V alone took ~9 ms a layer (a [2, 22k] x [22k, 64] product that
// OpenBLAS packs) against ~0.6 ms to stream V. Here one task per (sequence, kv head)
// reads each tile of K once for all the head's query rows (its query heads times the
// window; a quantized tile is unpacked once, v = q * scale + bias), then each row's
// softmax, then each tile of V once for all rows.
//
// Exactness across row counts and batches: a row attends to its keys in ascending
// order, the list fixed by the row alone: keys [0, n) with n = S - T + t + 1 for window
// position t (causal; n = S without a mask), or the keys its mask row keeps (a batch:
// left padding, rolled-back holes). Every step depends on that list alone: a score is
// one FMA chain over d (an 8-lane chain and `hsum8`'s tree); the max, the exps and their
// 8-lane sum run over the row's scores packed in list order and padded to a multiple of 8
// with -inf (exp 0); p = e / sum, elementwise; out[m, d] is one FMA chain over the list. So a verify window's row t gets the bits the single
// step at its position gets, and a row in a batch the bits it gets alone.

constexpr int KT = 64;  // keys per tile: a K or V tile (64 x D floats) stays in cache across the rows

// exp(x) for x <= 0 (and -inf), eight lanes: 2^(x log2 e) as 2^round * 2^frac, a degree-7
// Taylor polynomial on frac * ln 2 in [-0.35, 0.35] (relative error ~1e-7); below -87, 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
  const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, r), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// The forms below (`set_row_blocks`): the query rows that share a tile of keys blocked (or each
// row alone), and where the CPU has AVX-512 (wide) the blocks and the unpacking of quantized tiles
// on 16-lane registers. Every form gives the same bits.
bool row_blocks = true;
bool row_blocks_wide = true;

#define TGT512 __attribute__((target("avx512f,avx512dq,avx2,fma")))

const bool have_avx512 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}();

// Rows [s0, s1) of one head's keys or values as floats: fp32 buffers in place.
struct FloatRows {
  const float* base;  // [E, Sbuf, D]
  long Sbuf, D;
  const float* get(long e, long s0, long, float*) const { return base + (size_t(e) * Sbuf + s0) * D; }
};

// ... or a quantized buffer's rows unpacked into `tmp` (v = q * scale + bias, one FMA, as the value kernel above).
template <int BITS, int ST>
struct QuantRows {
  const uint32_t* w;  // [E, Sbuf, D*bits/32]
  const void* scales;  // [E, Sbuf, D/gs]
  const void* biases;
  long Sbuf, D;
  int gs;
  const float* get(long e, long s0, long s1, float* tmp) const {
    if (row_blocks_wide && have_avx512 && D % 16 == 0) return get512(e, s0, s1, tmp);
    const long Dw = D * BITS / 32, G = D / gs;
    for (long s = s0; s < s1; s++) {
      const uint32_t* wr = w + (size_t(e) * Sbuf + s) * Dw;
      const long g0 = (size_t(e) * Sbuf + s) * G;
      float* out = tmp + (s - s0) * D;
      for (long c = 0; c < D; c += 8) {
        const __m256 sc = _mm256_set1_ps(ld1<ST>(scales, g0 + c / gs)), bi = _mm256_set1_ps(ld1<ST>(biases, g0 + c / gs));
        _mm256_storeu_ps(out + c, _mm256_fmadd_ps(unpack8<BITS>(wr, int(c)), sc, bi));
      }
    }
    return tmp;
  }
  const float* get512(long e, long s0, long s1, float* tmp) const;
};

// The same unpacking 16 values at a time where the CPU has AVX-512: each value one FMA, q * scale + bias.
template <int BITS, int ST>
TGT512 __attribute__((noinline)) const float* unpack_rows512(const uint32_t* w, const void* scales, const void* biases,
                                                               long Sbuf, long D, int gs, long e, long s0, long s1,
                                                               float* tmp) {
  const long Dw = D * BITS / 32, G = D / gs;
  for (long s = s0; s < s1; s++) {
    const uint32_t* wr = w + (size_t(e) * Sbuf + s) * Dw;
    const long g0 = (size_t(e) * Sbuf + s) * G;
    float* out = tmp + (s - s0) * D;
    for (long c = 0; c < D; c += 16) {
      const __m512 sc = _mm512_set1_ps(ld1<ST>(scales, g0 + c / gs)), bi = _mm512_set1_ps(ld1<ST>(biases, g0 + c / gs));
      __m512 v;
      if constexpr (BITS == 8) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(wr) + c));
        v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
      } else {  // 16 nibbles of two words, element i at bits 4 (i % 8) of word i / 8
        const __m512i words = _mm512_set1_epi64((long long)(uint64_t(wr[c / 8]) | (uint64_t(wr[c / 8 + 1]) << 32)));
        const __m512i lo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i w32 = _mm512_permutexvar_epi32(lo, words);
        const __m512i sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        v = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w32, sh), _mm512_set1_epi32(0xF)));
      }
      _mm512_storeu_ps(out + c, _mm512_fmadd_ps(v, sc, bi));
    }
  }
  return tmp;
}

template <int BITS, int ST>
const float* QuantRows<BITS, ST>::get512(long e, long s0, long s1, float* tmp) const {
  return unpack_rows512<BITS, ST>(w, scales, biases, Sbuf, D, gs, e, s0, s1, tmp);
}

struct RowsJob {
  const float* q;  // [E * M, D], scaled
  const uint8_t* mask;  // [B, T, S] bool, or null
  float* out;  // [E * M, D]
  long M, T, S, D, Hkv;
  bool causal;
};

// Four keys' scores for one row: four independent FMA chains over d (the chain a key gets alone).
inline void scores4(const float* q, const float* const k[4], long D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (long d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + d), a3);
  }
  out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
}

inline float score1(const float* q, const float* k, long D) {
  __m256 a = _mm256_setzero_ps();
  for (long d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
  return hsum8(a);
}

// out[0 .. 8 NV) += p[j] * v[key j] for list entries [j0, j1): one FMA chain per column, j ascending.
template <int NV>
inline void values_block(const float* p, const int* idx, long j0, long j1, const float* vt, long s0, long D,
                         float* out) {
  __m256 a[NV];
  for (int i = 0; i < NV; i++) a[i] = _mm256_loadu_ps(out + 8 * i);
  for (long j = j0; j < j1; j++) {
    const __m256 ps = _mm256_broadcast_ss(p + j);
    const float* vr = vt + (idx[j] - s0) * D;
    for (int i = 0; i < NV; i++) a[i] = _mm256_fmadd_ps(ps, _mm256_loadu_ps(vr + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; i++) _mm256_storeu_ps(out + 8 * i, a[i]);
}

inline void values_row(const float* p, const int* idx, long j0, long j1, const float* vt, long s0, long D, float* out) {
  long d = 0;
  for (; d + 64 <= D; d += 64) values_block<8>(p, idx, j0, j1, vt + d, s0, D, out + d);
  switch ((D - d) / 8) {
    case 1: values_block<1>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 2: values_block<2>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 3: values_block<3>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 4: values_block<4>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 5: values_block<5>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 6: values_block<6>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    case 7: values_block<7>(p, idx, j0, j1, vt + d, s0, D, out + d); break;
    default: break;
  }
}

// Rows sharing a whole tile of keys (each row's list holds every key of [s0, s1)) are
// blocked: each load of a key or value vector serves R rows, where the one-row loops above
// load it once per row (at T=1 a kv head's four query rows re-read every K and V tile).
// Every (row, key) score is still one FMA chain over d and the same `hsum8`, every
// (row, column) output one FMA chain over the keys ascending: the bits `scores4` /
// `score1` and `values_block` give. Off (`set_row_blocks(false)`): the one-row loops only,
// as benchmarks compare.

// Scores of R rows (q[i], list entries from r[i]) against the NK keys k[0..NK): R x NK chains over d.
template <int R, int NK>
inline __attribute__((always_inline)) void scores_block(const float* const q[R], const float* const k[NK], long D,
                                                        float* const r[R]) {
  __m256 a[R][NK];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NK; j++) a[i][j] = _mm256_setzero_ps();
  for (long d = 0; d < D; d += 8) {
    __m256 kv[NK];
    for (int j = 0; j < NK; j++) kv[j] = _mm256_loadu_ps(k[j] + d);
    for (int i = 0; i < R; i++) {
      const __m256 qv = _mm256_loadu_ps(q[i] + d);
      for (int j = 0; j < NK; j++) a[i][j] = _mm256_fmadd_ps(qv, kv[j], a[i][j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < NK; j++) r[i][j] = hsum8(a[i][j]);
}

// Rows q[0..R) against every key of the tile kt [n, D], scores into r[i][0..n) (each row at the tile's first key).
template <int R>
void scores_rows(const float* const q[R], float* const r[R], const float* kt, long n, long D) {
  long s = 0;
  for (; s + 2 <= n; s += 2) {
    const float* k[2] = {kt + s * D, kt + (s + 1) * D};
    float* rs[R];
    for (int i = 0; i < R; i++) rs[i] = r[i] + s;
    scores_block<R, 2>(q, k, D, rs);
  }
  for (; s < n; s++) {
    const float* k[1] = {kt + s * D};
    float* rs[R];
    for (int i = 0; i < R; i++) rs[i] = r[i] + s;
    scores_block<R, 1>(q, k, D, rs);
  }
}

// out[i][0..16) += sum over the tile's n keys of p[i][s] * v[s, 0..16), R rows: one chain per column.
template <int R>
inline __attribute__((always_inline)) void values_rows16(const float* const p[R], const float* vt, long n, long D,
                                                         float* const out[R]) {
  __m256 a0[R], a1[R];
  for (int i = 0; i < R; i++) a0[i] = _mm256_loadu_ps(out[i]), a1[i] = _mm256_loadu_ps(out[i] + 8);
  for (long s = 0; s < n; s++) {
    const __m256 v0 = _mm256_loadu_ps(vt + s * D), v1 = _mm256_loadu_ps(vt + s * D + 8);
    for (int i = 0; i < R; i++) {
      const __m256 ps = _mm256_broadcast_ss(p[i] + s);
      a0[i] = _mm256_fmadd_ps(ps, v0, a0[i]);
      a1[i] = _mm256_fmadd_ps(ps, v1, a1[i]);
    }
  }
  for (int i = 0; i < R; i++) _mm256_storeu_ps(out[i], a0[i]), _mm256_storeu_ps(out[i] + 8, a1[i]);
}

template <int R>
void values_rows(const float* const p[R], const float* vt, long n, long D, float* const out[R]) {
  for (long d = 0; d < D; d += 16) {  // D is a multiple of 16 wherever blocks are taken
    float* o[R];
    for (int i = 0; i < R; i++) o[i] = out[i] + d;
    values_rows16<R>(p, vt + d, n, D, o);
  }
}

// The same blocks on 16-lane registers where the CPU has AVX-512 (half the FMA instructions).
// Values: a lane is one column's chain whatever the vector's width. Scores: two rows share a
// register, one in each 256-bit half (their q packed beforehand), each key's 8 values
// broadcast to both halves, so a half is the 8-lane chain over d of one (row, key) and
// `hsum8` of it the bits above.

template <int P, int NK>
TGT512 inline __attribute__((always_inline)) void scores_block512(const float* qp, const float* const k[NK], long D,
                                                                  float* const r[2 * P], int rows) {
  __m512 a[P][NK];
  for (int i = 0; i < P; i++)
    for (int j = 0; j < NK; j++) a[i][j] = _mm512_setzero_ps();
  for (long d = 0; d < D; d += 8) {
    __m512 qv[P];
    for (int i = 0; i < P; i++) qv[i] = _mm512_loadu_ps(qp + (size_t(i) * D + d) * 2);
    for (int j = 0; j < NK; j++) {
      const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(k[j] + d));
      for (int i = 0; i < P; i++) a[i][j] = _mm512_fmadd_ps(qv[i], kv, a[i][j]);
    }
  }
  for (int i = 0; i < P; i++)
    for (int j = 0; j < NK; j++) {
      r[2 * i][j] = hsum8(_mm512_castps512_ps256(a[i][j]));
      if (2 * i + 1 < rows) r[2 * i + 1][j] = hsum8(_mm512_extractf32x8_ps(a[i][j], 1));
    }
}

// Rows q[0..R) (R <= 4) against every key of the tile kt [n, D], scores into r[i][0..n).
template <int R>
TGT512 void scores_rows512(const float* const q[R], float* const r[R], const float* kt, long n, long D, float* qp) {
  constexpr int P = (R + 1) / 2;
  for (int i = 0; i < P; i++)  // pairs: 8 of row 2i, then 8 of row 2i + 1 (zeros past the last row)
    for (long d = 0; d < D; d += 8)
      for (int l = 0; l < 8; l++) {
        qp[(size_t(i) * D + d) * 2 + l] = q[2 * i][d + l];
        qp[(size_t(i) * D + d) * 2 + 8 + l] = 2 * i + 1 < R ? q[2 * i + 1][d + l] : 0.0f;
      }
  long s = 0;
  for (; s + 4 <= n; s += 4) {
    const float* k[4] = {kt + s * D, kt + (s + 1) * D, kt + (s + 2) * D, kt + (s + 3) * D};
    float* rs[2 * P];
    for (int i = 0; i < 2 * P; i++) rs[i] = i < R ? r[i] + s : nullptr;
    scores_block512<P, 4>(qp, k, D, rs, R);
  }
  for (; s < n; s++) {
    const float* k[1] = {kt + s * D};
    float* rs[2 * P];
    for (int i = 0; i < 2 * P; i++) rs[i] = i < R ? r[i] + s : nullptr;
    scores_block512<P, 1>(qp, k, D, rs, R);
  }
}

// values_rows on 16-lane registers, 32 columns a block (D a multiple of 32).
template <int R>
TGT512 void values_rows512(const float* const p[R], const float* vt, long n, long D, float* const out[R]) {
  for (long d = 0; d < D; d += 32) {
    __m512 a0[R], a1[R];
    for (int i = 0; i < R; i++) a0[i] = _mm512_loadu_ps(out[i] + d), a1[i] = _mm512_loadu_ps(out[i] + d + 16);
    for (long s = 0; s < n; s++) {
      const __m512 v0 = _mm512_loadu_ps(vt + s * D + d), v1 = _mm512_loadu_ps(vt + s * D + d + 16);
      for (int i = 0; i < R; i++) {
        const __m512 ps = _mm512_set1_ps(p[i][s]);
        a0[i] = _mm512_fmadd_ps(ps, v0, a0[i]);
        a1[i] = _mm512_fmadd_ps(ps, v1, a1[i]);
      }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out[i] + d, a0[i]), _mm512_storeu_ps(out[i] + d + 16, a1[i]);
  }
}

// Tiles: a block of query rows against a block of keys as a small GEMM, for windows whose many
// rows share every key tile (T = 16: 64 rows per kv head at 0.8B shapes). Scores: 4 row pairs
// (8 rows) x 6 keys or 2 pairs x 8 keys in 24 or 16 accumulators, each d step one load per
// pair and per key for 24 or 16 FMAs, q packed in pairs once per head. The sums of 8
// accumulators (16 dot products) are reduced together by shuffles, the additions in the tree
// `hsum8` uses, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so each score keeps its bits.
// Values: 6 rows x 64 columns per block over the tile's keys, the 64-column slice of V (16 KB)
// staying in L1 across the row blocks; each output one FMA chain over the keys ascending.
bool row_tiles = true;
bool tile_mutation = false;  // negative control (`set_tile_mutation`): the tiles' sums in another tree

// Half h of a[k] summed as hsum8 sums it, into w[4 (2 (k % 2) + h) + k / 2].
TGT512 inline __attribute__((always_inline)) void hsum8x16(const __m512* a, float* w) {
  __m512 x[4], z[2];
  for (int i = 0; i < 4; i++)  // 128-bit quarters: [a.lo.lo + a.lo.hi, a.hi.lo + a.hi.hi, b..., b...]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  // within quarters: [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
    z[i] = tile_mutation  // (mutated: x0 + x1, x2 + x3, ...: a tree no single row uses)
               ? _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xDD))
               : _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  _mm512_store_ps(w, _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD)));
}

// Pairs qp[0..P) (packed as for scores_block512) against the NK keys kt[0..NK) [NK, D]: r[2i + h][j].
template <int P, int NK>
TGT512 inline __attribute__((always_inline)) void scores_tile512(const float* qp, const float* kt, long D,
                                                                 float* const r[2 * P], long s) {
  static_assert(P * NK % 8 == 0, "reduced 8 accumulators at a time");
  __m512 a[P * NK];  // a[j P + i]: pair i, key j
  {  // the first step: FMAs on zero (zeroing a first became a memset of a on the stack)
    const __m512 zero = _mm512_setzero_ps();
    for (int j = 0; j < NK; j++) {
      const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(kt + j * D));
      for (int i = 0; i < P; i++) a[j * P + i] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + size_t(i) * D * 2), kv, zero);
    }
  }
  for (long d = 8; d < D; d += 8) {
    __m512 qv[P];
    for (int i = 0; i < P; i++) qv[i] = _mm512_loadu_ps(qp + (size_t(i) * D + d) * 2);
    for (int j = 0; j < NK; j++) {
      const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(kt + j * D + d));
      for (int i = 0; i < P; i++) a[j * P + i] = _mm512_fmadd_ps(qv[i], kv, a[j * P + i]);
    }
  }
  alignas(64) float w[16];
  for (int g = 0; g < P * NK / 8; g++) {
    hsum8x16(a + 8 * g, w);
    for (int k = 0; k < 8; k++) {
      const int f = 8 * g + k, i = f % P, j = f / P;
      r[2 * i][s + j] = w[4 * (2 * (k % 2)) + k / 2];
      r[2 * i + 1][s + j] = w[4 * (2 * (k % 2) + 1) + k / 2];
    }
  }
}

// 2P consecutive rows (their q packed in pairs at qp) against every key of the tile kt [n, D].
template <int P>
TGT512 void scores_pairs512(const float* qp, float* const r[2 * P], const float* kt, long n, long D) {
  constexpr int NK = P == 4 ? 6 : 8, NK2 = 8 / P;
  long s = 0;
  for (; s + NK <= n; s += NK) scores_tile512<P, NK>(qp, kt + s * D, D, r, s);
  for (; s + NK2 <= n; s += NK2) scores_tile512<P, NK2>(qp, kt + s * D, D, r, s);
  for (; s < n; s++) {
    const float* k[1] = {kt + s * D};
    float* rs[2 * P];
    for (int i = 0; i < 2 * P; i++) rs[i] = r[i] + s;
    scores_block512<P, 1>(qp, k, D, rs, 2 * P);
  }
}

// R rows' out[i][0..64) += sum over the tile's n keys of p[i][s] * v[s, 0..64): one chain per column.
template <int R>
TGT512 void values_tile512(const float* const p[R], const float* vt, long n, long D, float* const out[R]) {
  __m512 a[R][4];
  for (int i = 0; i < R; i++)
    for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(out[i] + 16 * c);
  for (long s = 0; s < n; s++) {
    __m512 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_ps(vt + s * D + 16 * c);
    for (int i = 0; i < R; i++) {
      const __m512 ps = _mm512_set1_ps(p[i][s]);
      for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(ps, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(out[i] + 16 * c, a[i][c]);
}

// Rows ps[0..nw) (probabilities at the tile's first key) times the tile vt [n, D] into os[i] (D % 64 == 0).
// With more rows than one block, each 64-column slice is first copied to `slice` [n, 64]: the rows
// of a cache lie D floats apart, a power of two, so a slice in place falls on a quarter of L1's sets
// and does not stay there across the row blocks.
TGT512 void values_rows_tiled512(const float* const* ps, float* const* os, long nw, const float* vt, long n, long D,
                                 float* slice) {
  for (long c = 0; c < D; c += 64) {
    const float* v = vt + c;
    long ld = D;
    if (nw > 6) {
      for (long s = 0; s < n; s++)
        for (int k = 0; k < 4; k++) _mm512_store_ps(slice + s * 64 + 16 * k, _mm512_loadu_ps(vt + s * D + c + 16 * k));
      v = slice, ld = 64;
    }
    for (long b = 0; b < nw; b += 6) {
      const long R = std::min<long>(6, nw - b);
      float* o[6];
      for (long i = 0; i < R; i++) o[i] = os[b + i] + c;
      switch (R) {
        case 6: values_tile512<6>(ps + b, v, n, ld, o); break;
        case 5: values_tile512<5>(ps + b, v, n, ld, o); break;
        case 4: values_tile512<4>(ps + b, v, n, ld, o); break;
        case 3: values_tile512<3>(ps + b, v, n, ld, o); break;
        case 2: values_tile512<2>(ps + b, v, n, ld, o); break;
        default: values_tile512<1>(ps + b, v, n, ld, o); break;
      }
    }
  }
}

// Whether row m's list, from entry j, holds exactly the keys [s0, s1) next (strictly ascending entries).
inline bool whole_tile(const int* idx, long j, long n, long s0, long s1) {
  const long c = s1 - s0;
  return j + c <= n && idx[j] == s0 && idx[j + c - 1] == s1 - 1;
}

struct Scratch {
  std::vector<int> idx, n, cur;  // each row's key list, its length, a cursor
  std::vector<float> total;  // each row's sum of exps
  std::vector<long> whole;  // the rows taking a whole tile
  std::vector<long> runs;  // their runs of 8 or 4 rows on tiles (first rows, then sizes)
  std::vector<float> qpack, qall;  // four rows' q in pairs (the AVX-512 scores); all the head's rows in pairs (tiles)
  std::vector<const float*> ps;  // the rows' probabilities and outputs at a tile (tiles)
  std::vector<float*> os;
  alignas(64) float slice[KT * 64];  // a 64-column slice of a V tile (tiles)
  std::vector<float> sc, tile;  // each row's scores (then probabilities), packed; an unpacked tile
};

// p = e / total for a row's entries [j0, j1), just before the values read them (one pass over
// the scores fewer than dividing the whole row first; a division has one result, so the same bits).
inline void divide(float* r, long j0, long j1, float total) {
  const __m256 t = _mm256_set1_ps(total);
  long j = j0;
  for (; j + 8 <= j1; j += 8) _mm256_storeu_ps(r + j, _mm256_div_ps(_mm256_loadu_ps(r + j), t));
  for (; j < j1; j++) r[j] /= total;
}

// Scores of the whole rows whole[0..nw) against the tile kt [n, D] on tiles: runs of 8 (then 4)
// consecutive rows from an even row, q from x.qall. Returns how many rows are left, compacted
// to the front of `whole` (for the four-row blocks).
inline long scores_tiled(Scratch& x, long* whole, long nw, const float* kt, long n, long D, long W) {
  long b = 0, left = 0, nb = 0;
  long *start = x.runs.data(), *size = start + nw / 4 + 1;  // the runs taken: first row, 8 or 4
  while (b < nw) {
    const long m = whole[b];
    const long R = m % 2 ? 0 : b + 8 <= nw && whole[b + 7] == m + 7 ? 8 : b + 4 <= nw && whole[b + 3] == m + 3 ? 4 : 0;
    if (R == 0) whole[left++] = whole[b++];
    else start[nb] = m, size[nb++] = R, b += R;
  }
  // Keys in parts of KP (24 KB at D = 256): a part stays in L1 across the runs, where the whole
  // tile (64 KB) would come from L2 for each run again.
  constexpr long KP = 24;
  for (long k0 = 0; k0 < n; k0 += KP)
    for (long i = 0; i < nb; i++) {
      const long m = start[i], R = size[i];
      float* rs[8];
      for (long r = 0; r < R; r++) rs[r] = x.sc.data() + (m + r) * W + x.cur[m + r] + k0;
      const float* qp = x.qall.data() + size_t(m / 2) * D * 2;
      if (R == 8) scores_pairs512<4>(qp, rs, kt + k0 * D, std::min(KP, n - k0), D);
      else scores_pairs512<2>(qp, rs, kt + k0 * D, std::min(KP, n - k0), D);
    }
  for (long i = 0; i < nb; i++)
    for (long r = 0; r < size[i]; r++) x.cur[start[i] + r] += int(n);
  return left;
}

// The head e's rows: keys, softmax, values.
template <class KV>
void rows_task(const RowsJob& jb, const KV& K, const KV& V, long e, Scratch& x) {
  const long M = jb.M, D = jb.D, S = jb.S, W = (S + 7) & ~7L;
  x.idx.resize(size_t(M) * S), x.n.assign(M, 0), x.cur.assign(M, 0), x.tile.resize(size_t(KT) * D), x.total.resize(M);
  x.whole.resize(M), x.qpack.resize(size_t(4) * D), x.ps.resize(M), x.os.resize(M), x.runs.resize(2 * (M / 4 + 1));
  const bool wide = row_blocks_wide && have_avx512, tiles = wide && row_tiles && row_blocks;
  x.sc.assign(size_t(M) * W, -std::numeric_limits<float>::infinity());
  for (long m = 0; m < M; m++) {  // the row's keys, ascending
    const long t = m % jb.T;
    int* idx = x.idx.data() + m * S;
    long n = 0;
    if (jb.mask != nullptr) {
      const uint8_t* mr = jb.mask + (size_t(e / jb.Hkv) * jb.T + t) * S;
      for (long s = 0; s < S; s++)
        if (mr[s]) idx[n++] = int(s);
    } else {
      n = jb.causal ? S - jb.T + t + 1 : S;
      for (long s = 0; s < n; s++) idx[s] = int(s);
    }
    x.n[m] = int(n);
  }
  const float* q = jb.q + size_t(e) * M * D;
  if (tiles && M >= 4) {  // every row's q in pairs, once (zeros past an odd last row)
    x.qall.resize(size_t((M + 1) / 2) * D * 2);
    for (long i = 0; 2 * i < M; i++)
      for (long d = 0; d < D; d += 8)
        for (int l = 0; l < 8; l++) {
          x.qall[(size_t(i) * D + d) * 2 + l] = q[2 * i * D + d + l];
          x.qall[(size_t(i) * D + d) * 2 + 8 + l] = 2 * i + 1 < M ? q[(2 * i + 1) * D + d + l] : 0.0f;
        }
  }
  for (long s0 = 0; s0 < S; s0 += KT) {  // K tile by tile, each tile for every row
    const long s1 = std::min(S, s0 + KT);
    const float* kt = nullptr;
    if (row_blocks) {  // rows taking the whole tile, four at a time
      long* whole = x.whole.data(), nw = 0;
      for (long m = 0; m < M; m++)
        if (whole_tile(x.idx.data() + m * S, x.cur[m], x.n[m], s0, s1)) whole[nw++] = m;
      if (nw > 0) kt = K.get(e, s0, s1, x.tile.data());
      if (tiles && M >= 4) nw = scores_tiled(x, whole, nw, kt, s1 - s0, D, W);  // leaves the rows it did not take
      for (long b = 0; b < nw; b += 4) {
        const float* qs[4];
        float* rs[4];
        const long R = std::min<long>(4, nw - b);
        for (long i = 0; i < R; i++) {
          const long m = whole[b + i];
          qs[i] = q + m * D, rs[i] = x.sc.data() + m * W + x.cur[m];
          x.cur[m] += int(s1 - s0);
        }
        if (wide) {
          float* qp = x.qpack.data();
          if (R == 4) scores_rows512<4>(qs, rs, kt, s1 - s0, D, qp);
          else if (R == 3) scores_rows512<3>(qs, rs, kt, s1 - s0, D, qp);
          else if (R == 2) scores_rows512<2>(qs, rs, kt, s1 - s0, D, qp);
          else scores_rows512<1>(qs, rs, kt, s1 - s0, D, qp);
        } else if (R == 4) scores_rows<4>(qs, rs, kt, s1 - s0, D);
        else if (R == 3) scores_rows<3>(qs, rs, kt, s1 - s0, D);
        else if (R == 2) scores_rows<2>(qs, rs, kt, s1 - s0, D);
        else scores_rows<1>(qs, rs, kt, s1 - s0, D);
      }
    }
    for (long m = 0; m < M; m++) {
      const int* idx = x.idx.data() + m * S;
      float* r = x.sc.data() + m * W;
      long j = x.cur[m], n = x.n[m];
      if (j >= n || idx[j] >= s1) continue;
      if (kt == nullptr) kt = K.get(e, s0, s1, x.tile.data());
      for (; j + 4 <= n && idx[j + 3] < s1; j += 4) {
        const float* k4[4] = {kt + (idx[j] - s0) * D, kt + (idx[j + 1] - s0) * D, kt + (idx[j + 2] - s0) * D,
                              kt + (idx[j + 3] - s0) * D};
        scores4(q + m * D, k4, D, r + j);
      }
      for (; j < n && idx[j] < s1; j++) r[j] = score1(q + m * D, kt + (idx[j] - s0) * D, D);
      x.cur[m] = int(j);
    }
  }
  for (long m = 0; m < M; m++) {  // softmax over the row's scores
    float* r = x.sc.data() + m * W;
    const long n8 = (long(x.n[m]) + 7) & ~7L;
    __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (long j = 0; j < n8; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(r + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    float top = lanes[0];
    for (int i = 1; i < 8; i++) top = std::max(top, lanes[i]);
    const __m256 tv = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (long j = 0; j < n8; j += 8) {
      const __m256 ex = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(r + j), tv));
      _mm256_storeu_ps(r + j, ex);
      sum = _mm256_add_ps(sum, ex);
    }
    x.total[m] = std::max(hsum8(sum), 1e-30f);  // a row with no key: zeros
  }
  float* out = jb.out + size_t(e) * M * D;
  std::fill(out, out + M * D, 0.0f);
  x.cur.assign(M, 0);
  for (long s0 = 0; s0 < S; s0 += KT) {  // V tile by tile, each tile for every row
    const long s1 = std::min(S, s0 + KT);
    const float* vt = nullptr;
    if (row_blocks && D % 16 == 0) {  // rows taking the whole tile, four at a time
      long* whole = x.whole.data(), nw = 0;
      for (long m = 0; m < M; m++)
        if (whole_tile(x.idx.data() + m * S, x.cur[m], x.n[m], s0, s1)) whole[nw++] = m;
      if (nw > 0) vt = V.get(e, s0, s1, x.tile.data());
      if (tiles && D % 64 == 0 && nw > 0) {
        for (long i = 0; i < nw; i++) {
          const long m = whole[i];
          x.ps[i] = x.sc.data() + m * W + x.cur[m], x.os[i] = out + m * D;
          divide(x.sc.data() + m * W, x.cur[m], x.cur[m] + (s1 - s0), x.total[m]);
          x.cur[m] += int(s1 - s0);
        }
        values_rows_tiled512(x.ps.data(), x.os.data(), nw, vt, s1 - s0, D, x.slice);
        nw = 0;
      }
      for (long b = 0; b < nw; b += 4) {
        const float* ps[4];
        float* os[4];
        const long R = std::min<long>(4, nw - b);
        for (long i = 0; i < R; i++) {
          const long m = whole[b + i];
          ps[i] = x.sc.data() + m * W + x.cur[m], os[i] = out + m * D;
          divide(x.sc.data() + m * W, x.cur[m], x.cur[m] + (s1 - s0), x.total[m]);
          x.cur[m] += int(s1 - s0);
        }
        if (wide && D % 32 == 0) {
          if (R == 4) values_rows512<4>(ps, vt, s1 - s0, D, os);
          else if (R == 3) values_rows512<3>(ps, vt, s1 - s0, D, os);
          else if (R == 2) values_rows512<2>(ps, vt, s1 - s0, D, os);
          else values_rows512<1>(ps, vt, s1 - s0, D, os);
        } else if (R == 4) values_rows<4>(ps, vt, s1 - s0, D, os);
        else if (R == 3) values_rows<3>(ps, vt, s1 - s0, D, os);
        else if (R == 2) values_rows<2>(ps, vt, s1 - s0, D, os);
        else values_rows<1>(ps, vt, s1 - s0, D, os);
      }
    }
    for (long m = 0; m < M; m++) {
      const int* idx = x.idx.data() + m * S;
      long j = x.cur[m], n = x.n[m], j1 = j;
      while (j1 < n && idx[j1] < s1) j1++;
      if (j1 == j) continue;
      if (vt == nullptr) vt = V.get(e, s0, s1, x.tile.data());
      divide(x.sc.data() + m * W, j, j1, x.total[m]);
      values_row(x.sc.data() + m * W, idx, j, j1, vt, s0, D, out + m * D);
      x.cur[m] = int(j1);
    }
  }
}

template <class KV>
void run_rows(const RowsJob& jb, const KV& K, const KV& V, long E) {
  auto part = [&](int i, int parts) {
    Scratch x;
    for (long e = E * i / parts; e < E * (i + 1) / parts; e++) rows_task(jb, K, V, e, x);
  };
  const long work = E * jb.M * jb.S * jb.D;
  if (parallel == nullptr || work < thread_min || E < 2) part(0, 1);
  else parallel(int(std::min<long>(E, 64)), part);
}

// Inputs: q, then K and V (fp32 [E, Sbuf, D]; or packed, scales, biases each), then the mask if any.
class AttentionRows : public mx::UnaryPrimitive {
 public:
  AttentionRows(mx::Stream s, long rows_per_head, long window, long keys, long kv_heads, bool causal, bool masked,
                int group_size, int bits)
      : mx::UnaryPrimitive(s), M_(rows_per_head), T_(window), S_(keys), Hkv_(kv_heads), causal_(causal),
        masked_(masked), gs_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = claim_output(stream(), inputs, out);
    const size_t nkv = bits_ ? 3 : 1;
    RowsJob jb{nullptr, nullptr, out.data<float>(), M_, T_, S_, inputs[0].shape(1), Hkv_, causal_};
    const long E = inputs[1].shape(0), Sbuf = inputs[1].shape(1);
    std::vector<RowMajor> in;
    for (const auto& a : inputs) in.emplace_back(a);
    const int st = bits_ ? scale_type(inputs[2].dtype()) : F32;
    enc.dispatch([jb, E, Sbuf, in, nkv, st, masked = masked_, gs = gs_, bits = bits_]() mutable {
      jb.q = in[0].get<float>();
      jb.mask = masked ? in[1 + 2 * nkv].get<uint8_t>() : nullptr;
      if (bits == 0) {
        run_rows(jb, FloatRows{in[1].get<float>(), Sbuf, jb.D}, FloatRows{in[2].get<float>(), Sbuf, jb.D}, E);
        return;
      }
      auto go = [&](auto tag) {
        using KV = decltype(tag);
        const KV K{in[1].get<uint32_t>(), in[2].get<char>(), in[3].get<char>(), Sbuf, jb.D, gs};
        const KV V{in[4].get<uint32_t>(), in[5].get<char>(), in[6].get<char>(), Sbuf, jb.D, gs};
        run_rows(jb, K, V, E);
      };
      if (bits == 8) {
        if (st == F32) go(QuantRows<8, F32>{});
        else if (st == BF16) go(QuantRows<8, BF16>{});
        else go(QuantRows<8, F16>{});
      } else {
        if (st == F32) go(QuantRows<4, F32>{});
        else if (st == BF16) go(QuantRows<4, BF16>{});
        else go(QuantRows<4, F16>{});
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp attention rows: CPU only");
  }

  const char* name() const override { return "MtpAttentionRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AttentionRows&>(other);
    return M_ == o.M_ && T_ == o.T_ && S_ == o.S_ && Hkv_ == o.Hkv_ && causal_ == o.causal_ && masked_ == o.masked_ &&
           gs_ == o.gs_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  long M_, T_, S_, Hkv_;
  bool causal_, masked_;
  int gs_, bits_;
};

// q [E * rows_per_head, D] float32, already scaled, E = B * kv_heads (row m of a head is window
// position m % window); kv: [k, v] fp32 [E, Sbuf >= keys, D] (the cache's buffers), or with
// bits 4/8 [k_packed, k_scales, k_biases, v_packed, v_scales, v_biases] in mlx-lm's quantized
// layout; mask: none, or bool [B, window, keys] (what a row may see, causality included)
// -> [E * rows_per_head, D]: softmax(q K[:keys]^T, masked) V[:keys].
mx::array attention_rows(const mx::array& q, const std::vector<mx::array>& kv, std::optional<mx::array> mask,
                         int rows_per_head, int window, int keys, int kv_heads, bool causal, int group_size, int bits) {
  const size_t nkv = bits ? 3 : 1;
  if (kv.size() != 2 * nkv || (bits != 0 && bits != 4 && bits != 8))
    throw std::invalid_argument("mtp attention rows: kv must be [k, v] (bits 0) or 6 quantized arrays (bits 4, 8)");
  if (q.dtype() != mx::float32 || q.ndim() != 2 || q.shape(1) % 8) throw std::invalid_argument("mtp attention rows: bad q");
  const long D = q.shape(1);
  for (size_t i = 0; i < kv.size(); i++) {
    const auto& a = kv[i];
    const bool data = i % nkv == 0;
    const long want = !bits ? D : data ? D * bits / 32 : D / std::max(group_size, 1);
    const bool dtype_ok = !bits ? a.dtype() == mx::float32 : data ? a.dtype() == mx::uint32
                          : (a.dtype() == mx::float32 || a.dtype() == mx::bfloat16 || a.dtype() == mx::float16);
    if (a.ndim() != 3 || !dtype_ok || a.shape(0) != kv[0].shape(0) || a.shape(1) != kv[0].shape(1) || a.shape(2) != want)
      throw std::invalid_argument("mtp attention rows: K/V buffers do not match q");
  }
  if (bits && (D % group_size || (group_size != 32 && group_size != 64 && group_size != 128) || kv[1].dtype() != kv[2].dtype() ||
               kv[4].dtype() != kv[1].dtype() || kv[5].dtype() != kv[1].dtype()))
    throw std::invalid_argument("mtp attention rows: bad group size or scales");
  const long E = kv[0].shape(0);
  if (rows_per_head < 1 || window < 1 || rows_per_head % window || long(q.shape(0)) != E * rows_per_head ||
      keys < window || keys > kv[0].shape(1) || kv_heads < 1 || E % kv_heads)
    throw std::invalid_argument("mtp attention rows: rows, window or keys do not match the cache");
  std::vector<mx::array> in = {q};
  in.insert(in.end(), kv.begin(), kv.end());
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->ndim() != 3 || mask->shape(0) != E / kv_heads || mask->shape(1) != window ||
        mask->shape(2) != keys)
      throw std::invalid_argument("mtp attention rows: mask must be bool [B, window, keys]");
    in.push_back(*mask);
  }
  auto s = mx::to_stream({});
  return mx::array(q.shape(), mx::float32,
                   std::make_shared<AttentionRows>(s, rows_per_head, window, keys, kv_heads, causal, bool(mask),
                                                   group_size, bits),
                   std::move(in));
}

}  // namespace qattn

// Called from quantized_matmul.cpp's module definition, with its thread pool.
void register_attention(nb::module_& m, ParallelFn run) {
  qattn::parallel = run;
  m.def("set_row_blocks",
        [](bool on, bool wide, bool tiles) { qattn::row_blocks = on, qattn::row_blocks_wide = wide, qattn::row_tiles = tiles; },
        "on"_a, "wide"_a = true, "tiles"_a = true,
        "attention_rows: rows sharing a whole key tile blocked (default) or each row alone; wide: the blocks and "
        "the unpacking of quantized tiles on 16-lane registers where the CPU has AVX-512; tiles (with wide): "
        "8 or 4 rows x several keys per block, reduced together (tests compare the forms)");
  m.def("tiles_supported", [] { return qattn::have_avx512; }, "whether set_row_blocks' tiles run here (AVX-512)");
  m.def("set_tile_mutation", [](bool on) { qattn::tile_mutation = on; }, "on"_a,
        "negative control for the row-invariance tests: the tiles' scores summed in another order");
  m.def("quantized_values", &qattn::quantized_values, "p"_a, "w"_a, "scales"_a, "biases"_a, "rows_per_head"_a,
        "group_size"_a, "bits"_a);
  m.def("attention_rows", &qattn::attention_rows, "q"_a, "kv"_a, "mask"_a.none(), "rows_per_head"_a, "window"_a,
        "keys"_a, "kv_heads"_a, "causal"_a, "group_size"_a, "bits"_a);
}
