// Decode-sized quantized matmuls on CPU, as MLX custom primitives.
//
// MLX 0.32's CPU `quantized_matmul` dequantizes each weight for every row of x
// and runs 4-10x slower than an fp32 matmul of the same shape, linearly in the
// rows (SPEC section 6), so a T-token verify window costs about T plain steps.
// Here y = x @ dequant(W)^T is computed for a few rows of x (decode steps,
// verify windows, drafts) reading each packed weight once for all rows:
//
//   y[m, n] = sum_g s[n, g] * (sum_{k in g} q[n, k] x[m, k]) + sum_g b[n, g] * xsum[m, g]
//
// so a weight is unpacked to float once and then costs one FMA per row of x.
// Unpacking: a lane holds one uint32 word; its j-th field is isolated with an
// AND against the field's mask (no shift), which leaves q * 2^(bits*j), a float
// with at most `bits` significant bits, converted exactly; x is stored once per
// call pre-scaled by 2^(-bits*j) in the matching lane order, so the products are
// exactly q * x (the top field is shifted down instead: it would read as negative).
//
// Exactness across row counts: each output element is the same sequence of
// operations (8-lane FMA chains per chunk of 8 words, one scale FMA per chunk,
// the bias term over groups, one horizontal sum) whatever the number of rows
// beside it or the split over threads, so a row's result is bit-identical
// for 1..any rows (verify windows score exactly like plain steps). Compiled with
// -ffp-contract=off so that scalar code is never contracted differently per path.
//
// Integer variant (mode int8, bits 4 and 8): each row of x is quantized by blocks
// of 32 to int8 (d = max|x| / 127, q = round(x / d), like llama.cpp's Q8_0), and
//
//   y[m, n] = sum_blocks s[n, g] * d[m, b] * (sum_{k in b} q[n, k] xq[m, k]) + sum_g b[n, g] * xsum[m, g]
//
// with the integer sums exact (4 bits: maddubs u8 x s8 then madd; 8 bits: madd
// s16 x s16) and xsum[m, g] = sum_{b in g} d[m, b] * sum_{k in b} xq[m, k], the sums
// of the rounded x: y is then dequant(W) against the rounded x. Per 64 weights an extra row
// then costs 7 instructions (maddubs x2, add, madd, convert, multiply, FMA)
// instead of 64 FMAs over 8 lanes and the unpacking. The float part of every
// output element is again one fixed sequence whatever the rows or threads, and
// quantizing x is per row, so rows stay bit-identical across row counts. It is
// not MLX's product: x loses precision to int8 (the tests state the error). On CPUs with
// AVX-512 VNNI and VBMI the integer sums are vpdpbusd instead (qmm_int8.inc), the same bits;
// 8-bit verify windows gain most (2B shapes, T=4: 181 -> 121 ms in the kernel, measured).
//
// Gathered variant (MoE experts, mlx-lm's `gather_qmm`): each (token, expert)
// pair's rows; pairs are grouped by expert so one expert's weights are read
// once for every row routed to it.

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// ------------------------------------------------------------------ scale/bias loads

#include "qmm_common.h"

template <int ST>
inline __m256 ld8(const void* p, long i) {
  if constexpr (ST == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (ST == BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  }
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  s = _mm_add_ss(s, _mm_movehl_ps(sh, s));
  return _mm_cvtss_f32(s);
}

// ------------------------------------------------------------------ the kernel

// x prepared once per call: per row, K floats in lane order (chunk c, field j,
// lane i -> x[(8c + i) * epw + j] * 2^(-bits*j)) and the G group sums of x.
struct Prep {
  int K, G, gs, bits;
  std::vector<float> xp, xs;

  void build(const float* x, long rows, int K_, int gs_, int bits_) {
    K = K_, gs = gs_, bits = bits_, G = K / gs;
    const int epw = 32 / bits, chunks = K / (8 * epw);
    xp.resize(size_t(rows) * K);
    xs.resize(size_t(rows) * G);
    for (long m = 0; m < rows; m++) {
      const float* xr = x + size_t(m) * K;
      float* p = xp.data() + size_t(m) * K;
      for (int c = 0; c < chunks; c++)
        for (int j = 0; j < epw; j++) {
          const float f = (j == 0 || j == epw - 1) ? 1.0f : std::ldexp(1.0f, -bits * j);
          for (int i = 0; i < 8; i++) *p++ = xr[(8 * c + i) * epw + j] * f;
        }
      for (int g = 0; g < G; g++) {
        float s = 0.0f;
        for (int k = 0; k < gs; k++) s += xr[g * gs + k];
        xs[size_t(m) * G + g] = s;
      }
    }
  }
};

// The scales of chunk c's 8 lanes. SPLIT: groups per chunk (1: the chunk lies in one group).
template <int ST, int SPLIT>
inline __m256 chunk_scale(const void* s, long row0, int c, int chunks_per_group) {
  if constexpr (SPLIT == 1) {
    return _mm256_set1_ps(ld1<ST>(s, row0 + c / chunks_per_group));
  } else if constexpr (SPLIT == 2) {
    return _mm256_setr_m128(_mm_set1_ps(ld1<ST>(s, row0 + 2 * c)), _mm_set1_ps(ld1<ST>(s, row0 + 2 * c + 1)));
  } else {
    const long g = row0 + 4 * c;
    const float a = ld1<ST>(s, g), b = ld1<ST>(s, g + 1), d = ld1<ST>(s, g + 2), e = ld1<ST>(s, g + 3);
    return _mm256_setr_ps(a, a, b, b, d, d, e, e);
  }
}

struct Job {
  const void* prep;  // Prep or PrepI8
  const uint32_t* w;  // this expert's [N, K*bits/32]
  const void* scales;  // [N, G]
  const void* biases;
  const int* rows;  // rows of x (and of out) this job computes
  int nrows;
  long N;
  float* out;  // [*, N]
};

// out[m, n + r] = hsum(acc[r][m]) + sum_g b[n + r, g] * xsum[m, g] (8 groups a lane, then the tail).
template <int ST>
inline __attribute__((always_inline)) void finish_one(const Job& jb, int row, long n, const float* xsums, int G,
                                                      __m256 acc) {
  const long b0 = n * long(G);
  const float* xs = xsums + size_t(row) * G;
  __m256 bacc = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= G; g += 8) bacc = _mm256_fmadd_ps(ld8<ST>(jb.biases, b0 + g), _mm256_loadu_ps(xs + g), bacc);
  float t = hsum(bacc);
  for (; g < G; g++) t = t + ld1<ST>(jb.biases, b0 + g) * xs[g];
  jb.out[size_t(row) * jb.N + n] = hsum(acc) + t;
}

template <int ST, int R, int MM>
inline __attribute__((always_inline)) void finish(const Job& jb, const int* rows, long n, const float* xsums, int G,
                                                  const __m256 (&acc)[R][MM]) {
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MM; m++) finish_one<ST>(jb, rows[m], n + r, xsums, G, acc[r][m]);
}

// R rows of W (from n) against MM rows of x (from rows).
template <int BITS, int ST, int SPLIT, int R, int MM>
inline __attribute__((always_inline)) void block(const Job& jb, const int* rows, long n) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t FIELD = (1u << BITS) - 1;
  const Prep& p = *static_cast<const Prep*>(jb.prep);
  const int K = p.K, G = p.G, Kw = K / EPW, chunks = Kw / 8;
  const int cpg = std::max(1, p.gs / (8 * EPW));
  const float* xr[MM];
  for (int m = 0; m < MM; m++) xr[m] = p.xp.data() + size_t(rows[m]) * K;
  const uint32_t* wr[R];
  for (int r = 0; r < R; r++) wr[r] = jb.w + size_t(n + r) * Kw;
  __m256 acc[R][MM];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < MM; m++) acc[r][m] = _mm256_setzero_ps();
  for (int c = 0; c < chunks; c++) {
    __m256i wv[R];
    for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + 8 * c));
    __m256 dot[R][MM];
#pragma GCC unroll 16
    for (int j = 0; j < EPW; j++) {
      __m256 xv[MM];
      for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(xr[m] + (size_t(c) * EPW + j) * 8);
      for (int r = 0; r < R; r++) {
        __m256i q = (j == EPW - 1) ? _mm256_srli_epi32(wv[r], BITS * j)
                                   : _mm256_and_si256(wv[r], _mm256_set1_epi32(int(FIELD << (BITS * j))));
        __m256 qf = _mm256_cvtepi32_ps(q);
        for (int m = 0; m < MM; m++) dot[r][m] = j == 0 ? _mm256_mul_ps(qf, xv[m]) : _mm256_fmadd_ps(qf, xv[m], dot[r][m]);
      }
    }
    for (int r = 0; r < R; r++) {
      const __m256 s = chunk_scale<ST, SPLIT>(jb.scales, (n + r) * long(G), c, cpg);
      for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(s, dot[r][m], acc[r][m]);
    }
  }
  finish<ST, R, MM>(jb, rows, n, p.xs.data(), G, acc);
}

// Rows [n0, n1) of W against all the job's rows of x, two rows of x at a time. Up to 4 rows
// of x, one row of W at a time: a single sequential stream per thread, which the hardware
// prefetcher follows best (EPYC/Zen 4, 4 bits, one thread from memory: one row of x, 6144 x
// 1024 in 182-200 us against 287-292 with 4 rows of W interleaved, the LM head 9.1-11.1 against
// 11.1-11.3 ms; four rows of x, the LM head 17.5-17.9 against 20.7-21.3 ms). More rows of x
// take 4 rows of W (2 KB at K = 1024, 4 bits: in L1 after the first pass), which unpacks each
// weight once for more of them: M = 8, 2.4 against 3.0 ms.
template <int BITS, int ST, int SPLIT, int R>
void span_rows(const Job& jb, long n0, long n1) {
  const int M = jb.nrows;
  long n = n0;
  for (; n + R <= n1; n += R) {
    int m = 0;
    for (; m + 2 <= M; m += 2) block<BITS, ST, SPLIT, R, 2>(jb, jb.rows + m, n);
    if (m < M) block<BITS, ST, SPLIT, R, 1>(jb, jb.rows + m, n);
  }
  for (; n < n1; n++) {
    int m = 0;
    for (; m + 2 <= M; m += 2) block<BITS, ST, SPLIT, 1, 2>(jb, jb.rows + m, n);
    if (m < M) block<BITS, ST, SPLIT, 1, 1>(jb, jb.rows + m, n);
  }
}

template <int BITS, int ST, int SPLIT>
void span(const Job& jb, long n0, long n1) {
  if (jb.nrows <= 4) span_rows<BITS, ST, SPLIT, 1>(jb, n0, n1);
  else span_rows<BITS, ST, SPLIT, 4>(jb, n0, n1);
}

using SpanFn = void (*)(const Job&, long, long);

template <int BITS, int ST>
SpanFn pick_split(int split) {
  if (split == 1) return span<BITS, ST, 1>;
  if (split == 2) return span<BITS, ST, 2>;
  return span<BITS, ST, 4>;
}

template <int BITS>
SpanFn pick_st(int st, int split) {
  if (st == F32) return pick_split<BITS, F32>(split);
  if (st == BF16) return pick_split<BITS, BF16>(split);
  return pick_split<BITS, F16>(split);
}

SpanFn pick(int bits, int st, int gs) {
  const int split = std::max(1, 8 * (32 / bits) / gs);
  if (bits == 2) return pick_st<2>(st, split);
  if (bits == 4) return pick_st<4>(st, split);
  return pick_st<8>(st, split);
}

// ------------------------------------------------------------------ the integer kernel (mode int8)

// x prepared once per call: per row, K int8s (4 bits: each chunk of 64 as the even
// elements then the odd ones, the order of the low and the high nibbles of its 32
// packed bytes; 8 bits: K int16s in order), the block scales d (4 bits: 8 floats a
// chunk, lanes 0-3 its first block's, 4-7 its second's; 8 bits: one a block) and
// the group sums of the rounded x.
struct PrepI8 {
  int K, G, gs, bits;
  std::vector<int8_t> q4;
  std::vector<int16_t> q8;
  std::vector<int8_t> q8v;  // 8 bits with VNNI: per block of 32, lane i's four (2i, 2i+1, 16+2i, 17+2i)
  std::vector<float> d, xs;

  void build(const float* x, long rows, int K_, int gs_, int bits_, bool vnni) {
    K = K_, gs = gs_, bits = bits_, G = K / gs;
    const int blocks = K / 32;
    std::vector<int8_t> q(K);
    std::vector<float> db(blocks);
    if (bits == 4) {
      q4.resize(size_t(rows) * K);
      d.resize(size_t(rows) * blocks * 4);
    } else {
      if (vnni) q8v.resize(size_t(rows) * K);
      else q8.resize(size_t(rows) * K);
      d.resize(size_t(rows) * blocks);
    }
    xs.resize(size_t(rows) * G);
    for (long m = 0; m < rows; m++) {
      const float* xr = x + size_t(m) * K;
      for (int b = 0; b < blocks; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xr[32 * b + i]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        db[b] = amax / 127.0f;
        for (int i = 0; i < 32; i++) q[32 * b + i] = int8_t(std::nearbyint(xr[32 * b + i] * id));
      }
      if (bits == 4) {
        int8_t* p = q4.data() + size_t(m) * K;
        float* dp = d.data() + size_t(m) * blocks * 4;
        for (int c = 0; c < K / 64; c++) {
          for (int i = 0; i < 32; i++) p[64 * c + i] = q[64 * c + 2 * i], p[64 * c + 32 + i] = q[64 * c + 2 * i + 1];
          for (int i = 0; i < 8; i++) dp[8 * c + i] = db[2 * c + i / 4];
        }
      } else {
        if (vnni) {
          int8_t* p = q8v.data() + size_t(m) * K;
          for (int b = 0; b < blocks; b++)
            for (int i = 0; i < 8; i++)
              for (int j = 0; j < 4; j++) p[32 * b + 4 * i + j] = q[32 * b + (j < 2 ? 2 * i + j : 14 + 2 * i + j)];
        } else {
          std::copy(q.begin(), q.end(), q8.begin() + size_t(m) * K);
        }
        std::copy(db.begin(), db.end(), d.begin() + size_t(m) * blocks);
      }
      // The bias term's sums are of the rounded x (d * sum of its int8s), so that the product is
      // dequant(W) against the rounded x: with exact sums, s * sum(q * x) and b * sum(x), which
      // nearly cancel (b is about -2^(bits-1) s), would keep the rounding error of the first alone.
      for (int g = 0; g < G; g++) {
        float s = 0.0f;
        for (int b = g * gs / 32; b < (g + 1) * gs / 32; b++) {
          int t = 0;
          for (int i = 0; i < 32; i++) t += q[32 * b + i];
          s += db[b] * float(t);
        }
        xs[size_t(m) * G + g] = s;
      }
    }
  }
};

// The blocks and spans, for AVX2/FMA and for AVX-512 VNNI (chosen per call: vnni_on).
#define QMM_INT8_VNNI 0
namespace avx2 {
#include "qmm_int8.inc"
}  // namespace avx2
#undef QMM_INT8_VNNI
#define QMM_INT8_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi")
namespace vnni {
#include "qmm_int8.inc"
}  // namespace vnni

// Many rows on AVX-512 VNNI: two rows of x share a 512-bit register, one in each 256-bit half,
// and each chunk of W is unpacked once into both halves (the 32 bytes broadcast) for a tile of
// 2 rows of W by 4 pairs (8 rows) of x. Lane l of a half runs the operations of lane l of the
// 256-bit form above (the same dpbusd sums, conversion, scale product and FMA, in chunk order),
// and `finish_one` reduces each half as it reduces that form's accumulator: each row keeps its
// bits whatever the rows beside it. Per 64 weights an extra pair of rows costs what one row
// costs in the 256-bit form (two dpbusd, a conversion, a multiply, an FMA), and the unpacking
// is shared by 8 rows instead of 4.
namespace vnni {

// Products of at least this many rows take the pair form (0: never; tests compare). Fewer rows stay on
// the 256-bit form, one sequential stream of W a thread (see span_int). CPU time of one thread, 0.8B
// shapes, int8 numerics: 4 rows 0.70 against 0.79 ms (4 bits, 3584 x 1024), 0.97 against 1.26 (8 bits).
int pair_min_rows = 4;

// The job's rows of x (of the prepared PrepI8) in pairs: per pair and chunk of 64 weights (4 bits)
// or block of 32 (8 bits), the int8s of both rows side by side (4 bits: low-nibble order of the
// first, of the second, then the high-nibble order of both), and their scales d, 8 lanes a row.
// A missing second row (odd counts) is zeros.
struct Pairs {
  std::vector<int8_t> q;
  std::vector<float> d;
};

template <int BITS>
void pack_pairs(const PrepI8& p, const int* rows, int M, Pairs& out) {
  const int K = p.K, P = (M + 1) / 2, units = BITS == 4 ? K / 64 : K / 32, qb = BITS == 4 ? 128 : 64;
  out.q.assign(size_t(P) * units * qb, 0);
  out.d.assign(size_t(P) * units * 16, 0.0f);
  for (int m = 0; m < M; m++) {
    const int pr = m / 2, h = m % 2;
    for (int u = 0; u < units; u++) {
      int8_t* q = out.q.data() + (size_t(pr) * units + u) * qb;
      float* d = out.d.data() + (size_t(pr) * units + u) * 16 + 8 * h;
      if constexpr (BITS == 4) {
        const int8_t* src = p.q4.data() + size_t(rows[m]) * K + 64 * u;
        std::memcpy(q + 32 * h, src, 32);
        std::memcpy(q + 64 + 32 * h, src + 32, 32);
        std::memcpy(d, p.d.data() + size_t(rows[m]) * (K / 8) + 8 * u, 8 * sizeof(float));
      } else {
        std::memcpy(q + 32 * h, p.q8v.data() + size_t(rows[m]) * K + 32 * u, 32);
        std::fill(d, d + 8, p.d[size_t(rows[m]) * (K / 32) + u]);
      }
    }
  }
}

inline __m256 half(__m512 v, int h) {
  return h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}

inline __m512 both_halves(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

// R rows of W (from n) against P pairs of x (from pair p0); `M`: the job's rows.
template <int BITS, int ST, int GS, int R, int P>
inline __attribute__((always_inline)) void pair_block(const Job& jb, const Pairs& pk, int M, int p0, long n) {
  const PrepI8& p = *static_cast<const PrepI8*>(jb.prep);
  const int K = p.K, G = p.G, Kw = K * BITS / 32, units = BITS == 4 ? K / 64 : K / 32, qb = BITS == 4 ? 128 : 64;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i lanes = _mm512_broadcast_i64x4(_mm256_setr_epi8(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22,
                                                                23, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14,
                                                                15, 30, 31));
  const uint32_t* wr[R];
  for (int r = 0; r < R; r++) wr[r] = jb.w + size_t(n + r) * Kw;
  __m512 acc[R][P];
  for (int r = 0; r < R; r++)
    for (int q = 0; q < P; q++) acc[r][q] = _mm512_setzero_ps();
  for (int u = 0; u < units; u++) {
    __m512i wa[R], wb[R];
    __m512 sv[R];
    for (int r = 0; r < R; r++) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + 8 * u)));
      const long g0 = (n + r) * long(G);
      if constexpr (BITS == 4) {
        wa[r] = _mm512_and_si512(v, low);
        wb[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (GS == 32)
          sv[r] = both_halves(_mm256_setr_m128(_mm_set1_ps(ld1<ST>(jb.scales, g0 + 2 * u)),
                                               _mm_set1_ps(ld1<ST>(jb.scales, g0 + 2 * u + 1))));
        else
          sv[r] = _mm512_set1_ps(ld1<ST>(jb.scales, g0 + u * 64 / GS));
      } else {
        wa[r] = _mm512_permutexvar_epi8(lanes, v);
        sv[r] = _mm512_set1_ps(ld1<ST>(jb.scales, g0 + u * 32 / GS));
      }
    }
    for (int q = 0; q < P; q++) {
      const int8_t* xq = pk.q.data() + (size_t(p0 + q) * units + u) * qb;
      const __m512i xa = _mm512_loadu_si512(xq);
      const __m512 dv = _mm512_loadu_ps(pk.d.data() + (size_t(p0 + q) * units + u) * 16);
      if constexpr (BITS == 4) {
        const __m512i xb = _mm512_loadu_si512(xq + 64);
        for (int r = 0; r < R; r++) {
          const __m512i i32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wa[r], xa), wb[r], xb);
          acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(sv[r], dv), acc[r][q]);
        }
      } else {
        for (int r = 0; r < R; r++) {
          const __m512i i32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa[r], xa);
          acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(sv[r], dv), acc[r][q]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int q = 0; q < P; q++)
      for (int h = 0; h < 2; h++) {
        const int m = 2 * (p0 + q) + h;
        if (m < M) finish_one<ST>(jb, jb.rows[m], n + r, p.xs.data(), G, half(acc[r][q], h));
      }
}

template <int BITS, int ST, int GS, int R>
inline __attribute__((always_inline)) void pair_tiles(const Job& jb, const Pairs& pk, long n) {
  const int M = jb.nrows, P = (M + 1) / 2;
  for (int p0 = 0; p0 < P; p0 += 4) {
    switch (std::min(4, P - p0)) {
      case 1: pair_block<BITS, ST, GS, R, 1>(jb, pk, M, p0, n); break;
      case 2: pair_block<BITS, ST, GS, R, 2>(jb, pk, M, p0, n); break;
      case 3: pair_block<BITS, ST, GS, R, 3>(jb, pk, M, p0, n); break;
      default: pair_block<BITS, ST, GS, R, 4>(jb, pk, M, p0, n); break;
    }
  }
}

template <int BITS, int ST, int GS>
void span_pairs(const Job& jb, long n0, long n1) {
  if (pair_min_rows == 0 || jb.nrows < pair_min_rows) return span_int<BITS, ST, GS>(jb, n0, n1);
  thread_local Pairs pk;  // this thread's copy of the job's rows in pairs
  pack_pairs<BITS>(*static_cast<const PrepI8*>(jb.prep), jb.rows, jb.nrows, pk);
  long n = n0;
  for (; n + 2 <= n1; n += 2) pair_tiles<BITS, ST, GS, 2>(jb, pk, n);
  for (; n < n1; n++) pair_tiles<BITS, ST, GS, 1>(jb, pk, n);
}

template <int BITS, int ST>
SpanFn pick_pairs_gs(int gs) {
  if (gs == 32) return span_pairs<BITS, ST, 32>;
  if (gs == 64) return span_pairs<BITS, ST, 64>;
  return span_pairs<BITS, ST, 128>;
}

template <int BITS>
SpanFn pick_pairs_st(int st, int gs) {
  if (st == F32) return pick_pairs_gs<BITS, F32>(gs);
  if (st == BF16) return pick_pairs_gs<BITS, BF16>(gs);
  return pick_pairs_gs<BITS, F16>(gs);
}

SpanFn pick_pairs(int bits, int st, int gs) { return bits == 4 ? pick_pairs_st<4>(st, gs) : pick_pairs_st<8>(st, gs); }

}  // namespace vnni
#pragma GCC pop_options
#undef QMM_INT8_VNNI

#include "qmm_group.inc"
#include "qmm_lanes.inc"
#include "qmm_amx.inc"

// The int8 numerics' form: per group of W (qmm_group.inc, the default) or per block of 32 (the
// forms above; benchmarks compare).
bool int8_group = true;

bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}
bool vnni_on = vnni_supported();  // set_vnni(False): the AVX2 form (tests compare the two)

// AVX-VNNI (CPUID leaf 7 subleaf 1, EAX bit 4): 256-bit vpdpbusd on chips without AVX-512 (Intel client
// cores); the group and lane forms' AVX2 path sums with it, the same bits (qmm_group.inc).
bool avx_vnni_supported() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1) && __builtin_cpu_supports("avx2");
}
bool avx_vnni_on = avx_vnni_supported();  // used where AVX-512 VNNI is not (set_vnni(False) on a chip with both)

// ------------------------------------------------------------------ thread pool

// The caller is part 0. Between products the workers spin for up to `spin_us` before
// sleeping on a condition variable, and the caller spins the same way for the workers to
// finish: a decode step runs a few hundred products of 0.05-0.3 ms with small ops between
// them, and a condition variable's wake-up (tens of microseconds) cost 2 threads most of
// their gain on the small ones (6144 x 1024, 4 bits, one row: 0.216 ms on 1 thread,
// 0.180 on 2, measured). A spin ends by time, so idle workers sleep.
class Pool {
 public:
  void set_threads(int n) {
    std::lock_guard<std::mutex> g(call_);
    threads_ = std::clamp(n, 1, 64);
  }
  int threads() const { return threads_; }
  void set_spin_us(long us) { spin_ns_ = std::max(0L, us) * 1000; }
  long spin_us() const { return spin_ns_ / 1000; }

  // fn(part, parts) on `parts` threads (fewer when another product holds the pool).
  void run(int parts, const std::function<void(int, int)>& fn) {
    if (parts <= 1 || !call_.try_lock()) {
      fn(0, 1);
      return;
    }
    parts = std::min(parts, threads_);
    while (int(workers_.size()) < parts - 1) {
      const int id = int(workers_.size()) + 1;
      workers_.emplace_back([this, id, seen = generation_.load()] { work(id, seen); });
      workers_.back().detach();
    }
    {
      std::lock_guard<std::mutex> g(m_);
      fn_ = &fn;
      parts_ = parts;
      pending_.store(int(workers_.size()), std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0, parts);
    if (!spin([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> g(m_);
      done_.wait(g, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    call_.unlock();
  }

 private:
  // Polls `ready` for up to spin_ns_; true once it holds.
  template <class F>
  bool spin(F ready) const {
    if (ready()) return true;
    const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns_);
    for (;;) {
      for (int i = 0; i < 32; i++) {
        _mm_pause();
        if (ready()) return true;
      }
      if (std::chrono::steady_clock::now() >= end) return false;
    }
  }

  void work(int id, unsigned long seen) {
    for (;;) {
      if (!spin([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> g(m_);
        wake_.wait(g, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      const std::function<void(int, int)>* fn;
      int parts;
      {
        std::lock_guard<std::mutex> g(m_);  // fn_ and parts_ as published with this generation
        seen = generation_.load(std::memory_order_acquire);
        fn = fn_;
        parts = parts_;
      }
      if (id < parts) (*fn)(id, parts);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(m_);  // the caller may be about to sleep on done_
        done_.notify_one();
      }
    }
  }

  std::mutex call_, m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int parts_ = 1, threads_ = 1;
  std::atomic<int> pending_{0};
  std::atomic<unsigned long> generation_{0};
  long spin_ns_ = 30000;  // 0.8B 4-bit decode: 30 us as fast as 100, 0 us 1.1x slower (measured)
};

// Never destroyed: at exit, destroying a condition variable its sleeping workers wait on blocks (glibc).
Pool& pool = *new Pool;
long thread_min = 1L << 19;  // weights (elements) below which one thread computes
std::atomic<long> calls{0};
std::atomic<long> busy_ns{0};  // time inside the kernel (benchmarks: its share of a step)

// ------------------------------------------------------------------ compute

// One product's share of a call: N rows of W, the rows of x they meet, and where the results go
// (out[rows[m] * N + n]). A dense product is one segment; gathered experts one per expert with
// rows routed to it; several products of one x (q/k/v, gate/up) one each, sharing the prepared x
// and one dispatch to the threads.
struct Segment {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  long N;
  std::vector<int> rows;
  float* out;
};

// lanes: the segments' weights, scales and biases are in the lane layout (qmm_lanes.inc; int8 numerics,
// 4 or 8 bits); threads then split W at blocks of 16 rows.
void compute(const float* x, long xrows, int K, int st, int gs, int bits, bool int8, const std::vector<Segment>& segs,
             bool lanes = false) {
  const auto t0 = std::chrono::steady_clock::now();
  Prep prep;
  PrepI8 prep8;
  PrepG prepg;
  int8 = int8 && (bits == 4 || bits == 8);  // 2 bits: the exact kernel
  if (lanes && !int8) throw std::invalid_argument("mtp qmm: the lane layout takes int8 numerics at 4 or 8 bits");
  const bool vnni = int8 && vnni_on, group = int8 && (int8_group || lanes), dp = int8 && !vnni && avx_vnni_on;
  if (group) prepg.build(x, xrows, K, gs, bits, !vnni && !dp && bits == 8);
  else if (int8) prep8.build(x, xrows, K, gs, bits, vnni);
  else prep.build(x, xrows, K, gs, bits);
  const bool amx = lanes && vnni && prepg.blk == 32 && amx_takes(bits, xrows);
  const SpanFn fn = amx    ? pick_amx(bits, st, int(xrows))
                    : lanes  ? pick_lanes(bits, st, vnni, dp)
                    : group  ? pick_group(bits, st, vnni, dp)
                    : !int8 ? pick(bits, st, gs)
                    : vnni  ? vnni::pick_pairs(bits, st, gs)
                            : avx2::pick_int(bits, st, gs);
  const void* pp = group  ? static_cast<const void*>(&prepg)
                   : int8 ? static_cast<const void*>(&prep8)
                          : static_cast<const void*>(&prep);
  const long align = lanes ? 16 : 1;  // a part starts at a block
  auto padded = [&](long N) { return (N + align - 1) / align * align; };
  long units = 0;
  for (const auto& sg : segs) units += padded(sg.N);
  auto part = [&](int p, int parts) {
    const long u0 = units / align * p / parts * align, u1 = units / align * (p + 1) / parts * align;
    long base = 0;  // the first unit of segment i
    for (const auto& sg : segs) {
      const long n0 = std::max(u0, base) - base, n1 = std::min(u1, base + padded(sg.N)) - base;
      if (n0 < n1) fn(Job{pp, sg.w, sg.scales, sg.biases, sg.rows.data(), int(sg.rows.size()), sg.N, sg.out}, n0, n1);
      base += padded(sg.N);
    }
  };
  const long work = units * K;
  const int parts = work < thread_min ? 1 : int(std::min<long>(pool.threads(), units / 8 > 0 ? units / 8 : 1));
  pool.run(parts, part);
  calls.fetch_add(1, std::memory_order_relaxed);
  busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                    std::memory_order_relaxed);
}

std::vector<int> all_rows(long n) {
  std::vector<int> rows(n);
  for (long m = 0; m < n; m++) rows[m] = int(m);
  return rows;
}

// ------------------------------------------------------------------ primitives

// x's leading dimensions, then W's rows.
mx::Shape out_shape(const mx::array& x, const mx::array& w) {
  mx::Shape shape = x.shape();
  shape.back() = w.shape(-2);
  return shape;
}

class QuantizedMatmulRows : public mx::UnaryPrimitive {
 public:
  // rows_per_pair == 0: dense (inputs x, w, scales, biases); otherwise gathered
  // (inputs x, w, scales, biases, indices; x holds rows_per_pair rows per index).
  QuantizedMatmulRows(mx::Stream s, int group_size, int bits, int rows_per_pair, bool int8)
      : mx::UnaryPrimitive(s), gs_(group_size), bits_(bits), rpp_(rows_per_pair), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& sc = inputs[2];
    auto& enc = claim_output(stream(), inputs, out);
    const long K = x.shape(-1), xrows = x.size() / K, N = w.shape(-2), G = K / gs_;
    const int st = scale_type(sc.dtype());
    const size_t ssz = st == F32 ? 4 : 2;
    enc.dispatch([x = RowMajor(x), w = RowMajor(w), sc = RowMajor(sc), bi = RowMajor(inputs[3]), o = out.data<float>(),
                  indices = rpp_ ? RowMajor(inputs[4]) : RowMajor(), pairs = rpp_ ? long(inputs[4].size()) : 0L,
                  rpp = rpp_, E = rpp_ ? long(w.shape(0)) : 1L, xrows, K, N, G, st, ssz, gs = gs_, bits = bits_,
                  int8 = int8_]() {
      const uint32_t* wp = w.get<uint32_t>();
      const char *sp = sc.get<char>(), *bp = bi.get<char>();
      std::vector<Segment> segs;
      if (rpp == 0) {
        segs.push_back({wp, sp, bp, N, all_rows(xrows), o});
      } else {  // group the pairs' rows by expert (indices are read only now: computed upstream)
        const uint32_t* idx = indices.get<uint32_t>();
        std::vector<std::vector<int>> by(E);
        for (long p = 0; p < pairs; p++) {
          const uint32_t e = idx[p];
          for (int r = 0; r < rpp; r++) {
            if (e < uint32_t(E)) by[e].push_back(int(p * rpp + r));
            else std::fill(o + (p * rpp + r) * N, o + (p * rpp + r + 1) * N, 0.0f);  // out of range: zeros
          }
        }
        const long Kw = K / (32 / bits);
        for (long e = 0; e < E; e++)
          if (!by[e].empty())
            segs.push_back({wp + size_t(e) * N * Kw, sp + size_t(e) * N * G * ssz, bp + size_t(e) * N * G * ssz, N,
                            std::move(by[e]), o});
      }
      compute(x.get<float>(), xrows, int(K), st, gs, bits, int8, segs);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mtp qmm: CPU only");
  }

  const char* name() const override {
    return rpp_ ? (int8_ ? "MtpGatherQMMRowsInt8" : "MtpGatherQMMRows") : (int8_ ? "MtpQMMRowsInt8" : "MtpQMMRows");
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulRows&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && rpp_ == o.rpp_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {out_shape(inputs[0], inputs[1])};
  }

 private:
  int gs_, bits_, rpp_;
  bool int8_;
};

// Several products of one x (inputs x, then w, scales, biases of each): one node, x prepared
// once, one dispatch to the threads. Each output's bits are its single product's.
class QuantizedMatmulMulti : public mx::Primitive {
 public:
  QuantizedMatmulMulti(mx::Stream s, int group_size, int bits, bool int8)
      : mx::Primitive(s), gs_(group_size), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = claim_outputs(stream(), inputs, outputs);
    const auto& x = inputs[0];
    const long K = x.shape(-1), xrows = x.size() / K;
    const int st = scale_type(inputs[2].dtype());
    std::vector<RowMajor> in(inputs.begin(), inputs.end());
    std::vector<std::pair<long, float*>> outs;
    for (size_t i = 0; i < outputs.size(); i++) outs.emplace_back(inputs[1 + 3 * i].shape(0), outputs[i].data<float>());
    enc.dispatch([in = std::move(in), outs, xrows, K, st, gs = gs_, bits = bits_, int8 = int8_]() {
      std::vector<Segment> segs;
      for (size_t i = 0; i < outs.size(); i++)
        segs.push_back({in[1 + 3 * i].get<uint32_t>(), in[2 + 3 * i].get<char>(), in[3 + 3 * i].get<char>(),
                        outs[i].first, all_rows(xrows), outs[i].second});
      compute(in[0].get<float>(), xrows, int(K), st, gs, bits, int8, segs);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtp qmm: CPU only");
  }

  const char* name() const override { return int8_ ? "MtpQMMMultiInt8" : "MtpQMMMulti"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulMulti&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 1; i < inputs.size(); i += 3) shapes.push_back(out_shape(inputs[0], inputs[i]));
    return shapes;
  }

 private:
  int gs_, bits_;
  bool int8_;
};

// Products of one x against weights in the lane layout (inputs x, then w, scales, biases of each; qmm_lanes.inc),
// int8 numerics: one node, x prepared once, one dispatch. N of each product is given (its last block is padded).
class QuantizedMatmulLanes : public mx::Primitive {
 public:
  QuantizedMatmulLanes(mx::Stream s, int group_size, int bits, std::vector<long> ns)
      : mx::Primitive(s), gs_(group_size), bits_(bits), ns_(std::move(ns)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = claim_outputs(stream(), inputs, outputs);
    const auto& x = inputs[0];
    const long K = x.shape(-1), xrows = x.size() / K;
    const int st = scale_type(inputs[2].dtype());
    std::vector<RowMajor> in(inputs.begin(), inputs.end());
    std::vector<float*> outs;
    for (auto& o : outputs) outs.push_back(o.data<float>());
    enc.dispatch([in = std::move(in), outs, ns = ns_, xrows, K, st, gs = gs_, bits = bits_]() {
      std::vector<Segment> segs;
      for (size_t i = 0; i < outs.size(); i++)
        segs.push_back({in[1 + 3 * i].get<uint32_t>(), in[2 + 3 * i].get<char>(), in[3 + 3 * i].get<char>(), ns[i],
                        all_rows(xrows), outs[i]});
      compute(in[0].get<float>(), xrows, int(K), st, gs, bits, true, segs, true);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mtp qmm: CPU only");
  }

  const char* name() const override { return "MtpQMMLanes"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmulLanes&>(other);
    return gs_ == o.gs_ && bits_ == o.bits_ && ns_ == o.ns_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (long n : ns_) {
      mx::Shape shape = inputs[0].shape();
      shape.back() = int(n);
      shapes.push_back(shape);
    }
    return shapes;
  }

 private:
  int gs_, bits_;
  std::vector<long> ns_;
};

void check(const mx::array& x, const mx::array& w, const mx::array& sc, const mx::array& bi, int gs, int bits,
           int wdims) {
  if (bits != 2 && bits != 4 && bits != 8) throw std::invalid_argument("mtp qmm: bits must be 2, 4 or 8");
  if (gs != 32 && gs != 64 && gs != 128) throw std::invalid_argument("mtp qmm: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32) throw std::invalid_argument("mtp qmm: x must be float32");
  if (w.dtype() != mx::uint32 || w.ndim() != wdims) throw std::invalid_argument("mtp qmm: bad packed weight");
  const int K = x.shape(-1);
  if (K % (8 * (32 / bits)) != 0 || K % gs != 0 || w.shape(-1) * (32 / bits) != K)
    throw std::invalid_argument("mtp qmm: K does not match the packed weight or is not a multiple of 8 words");
  if (sc.shape() != bi.shape() || sc.dtype() != bi.dtype() || sc.shape(-1) != K / gs || sc.shape(-2) != w.shape(-2))
    throw std::invalid_argument("mtp qmm: scales/biases do not match the weight");
  scale_type(sc.dtype());
}

// x [..., K] float32 -> [..., N] float32 (the inputs as they are: RowMajor packs any strided one).
mx::array qmm_rows(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                   int group_size, int bits, bool int8) {
  check(x, w, scales, biases, group_size, bits, 2);
  auto s = mx::to_stream({});
  return mx::array(out_shape(x, w), mx::float32, std::make_shared<QuantizedMatmulRows>(s, group_size, bits, 0, int8),
                   {x, w, scales, biases});
}

// x [..., K] float32 against several packed weights of one K, group size, bits and scale dtype
// -> one [..., N_i] float32 each.
std::vector<mx::array> qmm_rows_multi(const mx::array& x, const std::vector<std::tuple<mx::array, mx::array, mx::array>>& ws,
                                      int group_size, int bits, bool int8) {
  if (ws.empty()) throw std::invalid_argument("mtp qmm: no weights");
  std::vector<mx::array> in = {x};
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& [w, sc, bi] : ws) {
    check(x, w, sc, bi, group_size, bits, 2);
    if (sc.dtype() != std::get<1>(ws[0]).dtype()) throw std::invalid_argument("mtp qmm: one scale dtype for all weights");
    in.insert(in.end(), {w, sc, bi});
    shapes.push_back(out_shape(x, w));
    dtypes.push_back(mx::float32);
  }
  auto s = mx::to_stream({});
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<QuantizedMatmulMulti>(s, group_size, bits, int8), std::move(in));
}

// x [P * rows_per_pair, K] float32, indices [P] (expert of each pair) -> [P * rows_per_pair, N].
mx::array gather_qmm_rows(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                          const mx::array& indices, int rows_per_pair, int group_size, int bits, bool int8) {
  check(x, w, scales, biases, group_size, bits, 3);
  if (rows_per_pair < 1 || long(indices.size()) * rows_per_pair != long(x.size() / x.shape(-1)))
    throw std::invalid_argument("mtp gather qmm: x rows != indices * rows_per_pair");
  auto s = mx::to_stream({});
  auto idx = indices.dtype() == mx::uint32 ? indices : mx::astype(indices, mx::uint32, s);
  return mx::array(out_shape(x, w), mx::float32,
                   std::make_shared<QuantizedMatmulRows>(s, group_size, bits, rows_per_pair, int8),
                   {x, w, scales, biases, idx});
}

// x [..., K] float32 against weights in the lane layout, each (w [N/16, K*bits/32, 16] uint32, scales and
// biases [N/16, G, 16], N) -> one [..., N] float32 each; int8 numerics, bits 4 or 8.
std::vector<mx::array> qmm_lanes(const mx::array& x, const std::vector<std::tuple<mx::array, mx::array, mx::array, long>>& ws,
                                 int group_size, int bits) {
  if (ws.empty()) throw std::invalid_argument("mtp qmm: no weights");
  if (bits != 4 && bits != 8) throw std::invalid_argument("mtp qmm lanes: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("mtp qmm: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32) throw std::invalid_argument("mtp qmm: x must be float32");
  const int K = x.shape(-1);
  std::vector<mx::array> in = {x};
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<long> ns;
  for (const auto& [w, sc, bi, N] : ws) {
    if (w.dtype() != mx::uint32 || w.ndim() != 3 || w.shape(2) != 16 || long(w.shape(1)) * (32 / bits) != K ||
        K % (8 * (32 / bits)) != 0 || K % group_size != 0)
      throw std::invalid_argument("mtp qmm lanes: bad lane weight for this x");
    if (N <= long(w.shape(0) - 1) * 16 || N > long(w.shape(0)) * 16) throw std::invalid_argument("mtp qmm lanes: bad N");
    if (sc.shape() != bi.shape() || sc.dtype() != bi.dtype() || sc.ndim() != 3 || sc.shape(0) != w.shape(0) ||
        sc.shape(1) != K / group_size || sc.shape(2) != 16)
      throw std::invalid_argument("mtp qmm lanes: scales/biases do not match the weight");
    if (sc.dtype() != std::get<1>(ws[0]).dtype()) throw std::invalid_argument("mtp qmm: one scale dtype for all weights");
    scale_type(sc.dtype());
    in.insert(in.end(), {w, sc, bi});
    mx::Shape shape = x.shape();
    shape.back() = int(N);
    shapes.push_back(shape);
    dtypes.push_back(mx::float32);
    ns.push_back(N);
  }
  auto s = mx::to_stream({});
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<QuantizedMatmulLanes>(s, group_size, bits, std::move(ns)), std::move(in));
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace

// Attention's value product over quantized KV (quantized_attention.cpp), on this file's pool.
void register_attention(nb::module_& m, void (*run)(int, const std::function<void(int, int)>&));
// The GatedDeltaNet recurrence of decode steps and verify windows (gated_delta.cpp), on this file's pool.
void register_gated_delta(nb::module_& m, void (*run)(int, const std::function<void(int, int)>&));
// Sigmoid, SiLU, SwiGLU, RMS norm, the decode conv and RoPE with MLX's bits (activations.cpp).
void register_activations(nb::module_& m);

NB_MODULE(_mtp_qmm, m) {
  m.doc() = "mtp-serve's decode-sized quantized matmuls (CPU, AVX2/FMA)";
  m.def("qmm_rows", &qmm_rows, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a, "int8"_a = false);
  m.def("qmm_rows_multi", &qmm_rows_multi, "x"_a, "weights"_a, "group_size"_a, "bits"_a, "int8"_a = false);
  m.def("gather_qmm_rows", &gather_qmm_rows, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a, "rows_per_pair"_a,
        "group_size"_a, "bits"_a, "int8"_a = false);
  m.def("qmm_lanes", &qmm_lanes, "x"_a, "weights"_a, "group_size"_a, "bits"_a);
  m.def("cpu_supported", &cpu_supported);
  m.def("set_threads", [](int n) { pool.set_threads(n); });
  m.def("threads", [] { return pool.threads(); });
  m.def("set_spin_us", [](long us) { pool.set_spin_us(us); }, "us"_a);
  m.def("spin_us", [] { return pool.spin_us(); });
  m.def("vnni_supported", &vnni_supported);
  m.def("set_vnni", [](bool on) { vnni_on = on && vnni_supported(); });
  m.def("avx_vnni_supported", &avx_vnni_supported);
  m.def("set_avx_vnni", [](bool on) { avx_vnni_on = on && avx_vnni_supported(); });
  m.def("avx_vnni", [] { return avx_vnni_on; });
  m.def("vnni", [] { return vnni_on; });
  m.def("amx_supported", &gamx::supported);
  m.def("set_amx", [](bool on) { amx_on = on && gamx::supported(); }, "on"_a);
  m.def("amx", [] { return amx_on; });
  m.def("set_prefetch_distance", [](long bytes) { gvnni::prefetch_distance = bytes; }, "bytes"_a);
  m.def("prefetch_distance", [] { return gvnni::prefetch_distance; });
  m.def("set_amx_rows", [](int rows, int bits) {
    for (int b : {4, 8})
      if (bits == 0 || bits == b) amx_min_rows[b == 8] = std::max(0, rows);
  }, "rows"_a, "bits"_a = 0);
  m.def("amx_rows", [](int bits) { return amx_min_rows[bits == 8]; }, "bits"_a);
  m.def("set_pair_rows", [](int rows) { vnni::pair_min_rows = std::max(0, rows); }, "rows"_a);
  m.def("pair_rows", [] { return vnni::pair_min_rows; });
  m.def("set_int8_group", [](bool on) { int8_group = on; }, "on"_a);
  m.def("int8_group", [] { return int8_group; });
  m.def("set_group_mutation", [](bool on) { group_mutation = on; }, "on"_a);
  m.def("set_x_block", [](int n) {
    if (n != 0 && n != 32 && n != 64 && n != 128) throw std::invalid_argument("mtp qmm: x_block must be 0, 32, 64 or 128");
    x_block = n;
  }, "values"_a);
  m.def("x_block", [] { return x_block; });
  m.def("set_thread_min", [](long n) { thread_min = n; });
  m.def("calls", [] { return calls.load(); });
  m.def("seconds", [] { return busy_ns.load() * 1e-9; });
  register_attention(m, [](int parts, const std::function<void(int, int)>& fn) { pool.run(parts, fn); });
  register_gated_delta(m, [](int parts, const std::function<void(int, int)>& fn) { pool.run(parts, fn); });
  register_activations(m);
}
