/* What AMX's tiles cost on this CPU, alone: the ceiling the quantized windows' AMX form
   (mtp_serve/native/qmm_amx.inc) works under.

     gcc -O3 -march=sapphirerapids -o /tmp/amx_tiles bench/amx_tiles.c && /tmp/amx_tiles

   One thread, everything in L1: tdpbsud's throughput (4 independent C tiles); one 32-value block
   of 16 rows of x against 16 rows of W as the kernel runs it (tile zero, A and B loads, the dot,
   the store, and the float chain reading the int32 sums back: acc = fma(float(I), s * d, acc) per
   row), pipelined over four C tiles as the kernel is; the same with the block's 4-bit words split
   into bytes before the tiles read them (as the kernel does once per block of W); and each of
   the two with A, B and the split buffer 8 bytes past a 64-byte line (where MLX's CPU buffers and
   heap vectors sit). Linux 5.16+ grants the tile state on request. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define K 1024
#define NB (K / 32)
#define REPS 100000

typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static int8_t A_[16 * K + 64] __attribute__((aligned(64)));
static uint8_t B_[NB * 512 + 64] __attribute__((aligned(64)));
static uint8_t W[NB * 256] __attribute__((aligned(64)));
static int32_t I[4][256] __attribute__((aligned(64)));
static float xd[16][NB];
static int8_t* A;
static uint8_t* B;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define ISSUE(c0, c1, b)                                   \
  do {                                                     \
    _tile_zero(c0);                                        \
    _tile_loadd(4, A + (b) * 32, K);                       \
    _tile_loadd(6, B + (b) * 512, 64);                     \
    _tile_dpbsud(c0, 4, 6);                                \
    _tile_zero(c1);                                        \
    _tile_loadd(5, A + ((b) + 1) * 32, K);                 \
    _tile_loadd(7, B + ((b) + 1) * 512, 64);               \
    _tile_dpbsud(c1, 5, 7);                                \
  } while (0)

static inline void chain(__m512* acc, const int32_t* Ib, int b, __m512 sg) {
  for (int m = 0; m < 16; m++)
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(Ib + m * 16)),
                             _mm512_mul_ps(sg, _mm512_set1_ps(xd[m][b])), acc[m]);
}

static void split_nibbles(void) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < NB * 4; j++) {
    const __m512i w = _mm512_load_si512(W + j * 64);
    _mm512_storeu_si512(B + 2 * j * 64, _mm512_and_si512(w, low));
    _mm512_storeu_si512(B + (2 * j + 1) * 64, _mm512_and_si512(_mm512_srli_epi32(w, 4), low));
  }
}

/* ns per block of the pipelined round, with the 4-bit split per pass over the NB blocks or not. */
static double pipelined(int split) {
  __m512 acc[16];
  const __m512 sg = _mm512_set1_ps(0.5f);
  for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
  const double t0 = now();
  for (int r = 0; r < REPS; r++) {
    if (split) split_nibbles();
    ISSUE(0, 1, 0);
    ISSUE(2, 3, 2);
    for (int b = 0; b < NB; b += 4) {
      _tile_stored(0, I[0], 64);
      _tile_stored(1, I[1], 64);
      if (b + 4 < NB) ISSUE(0, 1, b + 4);
      chain(acc, I[0], b, sg);
      chain(acc, I[1], b + 1, sg);
      _tile_stored(2, I[2], 64);
      _tile_stored(3, I[3], 64);
      if (b + 6 < NB) ISSUE(2, 3, b + 6);
      chain(acc, I[2], b + 2, sg);
      chain(acc, I[3], b + 3, sg);
    }
  }
  const double t = now() - t0;
  float s = 0;
  for (int m = 0; m < 16; m++) s += _mm512_reduce_add_ps(acc[m]);
  if (s != s) printf("(nan)\n");
  return t / ((double)REPS * NB) * 1e9;
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    printf("no AMX tile state granted (CPU without AMX, or Linux before 5.16)\n");
    return 1;
  }
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  for (int m = 0; m < 16; m++)
    for (int b = 0; b < NB; b++) xd[m][b] = 1e-3f * (m + b);
  A = A_, B = B_;
  _tile_loadd(4, A, K);
  _tile_loadd(5, A + 32, K);
  _tile_loadd(6, B, 64);
  _tile_loadd(7, B + 512, 64);
  const long n = 20 * REPS;
  double t0 = now();
  for (long i = 0; i < n; i++) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 5, 7);
    _tile_dpbsud(2, 4, 7);
    _tile_dpbsud(3, 5, 6);
  }
  double t = now() - t0;
  printf("tdpbsud alone: %.2f ns each (16 x 16 x 32 int8: %.0f G multiply-adds/s on one core)\n",
         t / (4.0 * n) * 1e9, 4.0 * n * 8192 / t / 1e9);
  for (int off = 0; off <= 8; off += 8) {
    A = A_ + off, B = B_ + off;
    const double plain = pipelined(0), split = pipelined(1);
    printf("a block of 16 rows, pipelined, operands %d bytes past a line: %.1f ns (%.0f G multiply-adds/s); "
           "with the 4-bit split: %.1f ns\n", off, plain, 8192 / plain, split);
  }
  _tile_release();
  return 0;
}
