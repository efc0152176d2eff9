/* cblas_sgemm for decode-sized products, in front of OpenBLAS's.

   MLX's CPU backend computes every fp32 matmul with cblas_sgemm. A decode step
   or a verify window multiplies a few rows (M <= 8) by each weight matrix:
   y = x W^T with W [N, K] row-major, read once per step, so the time is the
   time to stream W from memory. Debian's OpenBLAS 0.3.21 sgemm takes those
   shapes through its packing gemm path at about 13 GB/s on this project's
   machines (a 248,320 x 1,024 LM head: 80 ms at M = 1, 102 ms at M = 4), while
   its own sgemv streams 31 GB/s (32 ms). This file exports `cblas_sgemm`; it is
   loaded (RTLD_GLOBAL) before OpenBLAS, so MLX's calls reach it first. Products
   of that shape go through the kernel below, smaller products of up to 64 rows
   through the row-invariant kernel further down; everything else is
   passed on unchanged to OpenBLAS's cblas_sgemm (`mtp_skinny_set_fallback`).

   Every output element is one 8-lane FMA chain over k, then the same horizontal
   sum and scalar tail, whatever M is and however rows are grouped or split over
   threads: a row's result does not depend on the other rows of the product, so a
   verify window's logits equal, bit for bit, the one-token steps' (OpenBLAS's
   M = 1 and M > 1 paths round differently).

   Only products whose W has at least `skinny_min` elements are taken (the loader
   sets 1M, 4 MB: below that W sits in cache and streaming speed does not matter;
   OpenBLAS's kernels won on the demo model then, and now the row-invariant kernel,
   as fast or faster at decode sizes, takes them).

   Threads: a small pool of pthreads (the caller is thread 0) splits the N rows
   of W; products under `thread_min` elements of W run on the caller alone. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define TGT __attribute__((target("avx2,fma")))
#define MAX_ROWS 8 /* rows `span` takes in one pass */
#define MAX_THREADS 64

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);

static sgemm_fn fallback;
static int n_threads = 1;
static const long thread_min = 1L << 18; /* smaller W (under 1 MB): waking the pool costs more than it saves */
static long skinny_min = 0; /* elements of W below which OpenBLAS computes (`mtp_skinny_set_min`) */
static long calls;
static int skinny_max_rows = 64; /* rows of the large products taken from OpenBLAS: decode steps and verify windows
                                    (`mtp_skinny_set_max_rows`: benchmarks compare with 8, OpenBLAS beyond) */

/* ------------------------------------------------------------------ kernel */

TGT static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    s = _mm_add_ss(s, _mm_movehl_ps(sh, s));
    return _mm_cvtss_f32(s);
}

/* The scalar tail of every output, k in [K8, K): one out-of-line function, so every kernel form
   (and every inlining of it) rounds the tail the same way. */
TGT __attribute__((noinline)) static float tail_sum(float s, const float *x, const float *w, int K8, int K) {
    for (int k = K8; k < K; k++) s += x[k] * w[k];
    return s;
}

/* No call where there is no tail (K a multiple of 8: every model's products). */
#define tail(s, x, w, K8, K) ((K8) < (K) ? tail_sum((s), (x), (w), (K8), (K)) : (s))

/* R rows of w against M rows of x (R, M and PF compile-time constants after inlining).
   With PF, the next R rows of w are prefetched a cache line per row every 16 k: the
   hardware prefetcher alone leaves the 4-row (verify window) products 10% slower. */
TGT static inline __attribute__((always_inline)) void block(const int R, const int M, const int PF, long n, int K,
                                                             const float *x, int ldx, const float *w, int ldw,
                                                             float *out, int ldo) {
    __m256 acc[16];
    for (int i = 0; i < R * M; i++) acc[i] = _mm256_setzero_ps();
    const int K8 = K & ~7;
    for (int k = 0; k < K8; k += 8) {
        __m256 xv[8];
        for (int m = 0; m < M; m++) xv[m] = _mm256_loadu_ps(x + (size_t)m * ldx + k);
        if (PF && (k & 15) == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (size_t)(n + R + r) * ldw + k), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m256 wv = _mm256_loadu_ps(w + (size_t)(n + r) * ldw + k);
            for (int m = 0; m < M; m++) acc[r * M + m] = _mm256_fmadd_ps(xv[m], wv, acc[r * M + m]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float *wr = w + (size_t)(n + r) * ldw;
        for (int m = 0; m < M; m++) out[(size_t)m * ldo + n + r] = tail(hsum256(acc[r * M + m]), x + (size_t)m * ldx, wr, K8, K);
    }
}

/* Rows [n0, n1) of W against rows [m0, m0 + M) of x. */
#define BLOCK(R, m0, M, PF, n) block(R, M, PF, n, K, x + (size_t)(m0) * ldx, ldx, w, ldw, out + (size_t)(m0) * ldo, ldo)

/* Rows [n0, n1) of W. R is chosen per M to keep the accumulators in the 16 registers;
   past 5 rows of x, each group of R rows of W (in L1 by then) meets x in two parts. */
#define SPAN(R, M1, M2)                                                                \
    {                                                                                  \
        long n = n0;                                                                   \
        for (; n + R <= n1; n += R) {                                                  \
            BLOCK(R, 0, M1, 1, n);                                                     \
            if (M2) BLOCK(R, M1, M2, 0, n);                                            \
        }                                                                              \
        for (; n < n1; n++) {                                                          \
            BLOCK(1, 0, M1, 0, n);                                                     \
            if (M2) BLOCK(1, M1, M2, 0, n);                                            \
        }                                                                              \
    }                                                                                  \
    break;

TGT static void span(int M, long n0, long n1, int K, const float *x, int ldx, const float *w, int ldw, float *out,
                     int ldo) {
    switch (M) {
        case 1: SPAN(4, 1, 0)
        case 2: SPAN(4, 2, 0)
        case 3: SPAN(4, 3, 0)
        case 4: SPAN(2, 4, 0)
        case 5: SPAN(2, 5, 0)
        case 6: SPAN(2, 3, 3)
        case 7: SPAN(2, 4, 3)
        default: SPAN(2, 4, 4)
    }
}

/* Any number of rows on AVX2: each group of 2 rows of W (in L1 after the first group of x)
   meets x four rows at a time, each row through the same `block` as above. */
#define BLOCK_ROWS(R, m0, M, PF, n)                                  \
    switch (M) {                                                     \
        case 1: BLOCK(R, m0, 1, PF, n); break;                       \
        case 2: BLOCK(R, m0, 2, PF, n); break;                       \
        case 3: BLOCK(R, m0, 3, PF, n); break;                       \
        default: BLOCK(R, m0, 4, PF, n); break;                      \
    }

TGT static void span_rows(int M, long n0, long n1, int K, const float *x, int ldx, const float *w, int ldw,
                          float *out, int ldo) {
    long n = n0;
    for (; n + 2 <= n1; n += 2) {
        BLOCK(2, 0, 4, 1, n);
        for (int m = 4; m < M; m += 4) BLOCK_ROWS(2, m, M - m, 0, n)
    }
    for (; n < n1; n++)
        for (int m = 0; m < M; m += 4) BLOCK_ROWS(1, m, M - m, 0, n)
}

/* --------------------------------------------------- wide windows, AVX-512

   The same sums on 16-lane registers: two rows of x share a register, one in each 256-bit
   half (x packed beforehand into pairs, 8 k of one row then 8 k of the other), and each 8 k
   of a row of W is broadcast to both halves. Lane l of a half is still the FMA chain over
   k = l, l + 8, ... of one output, followed by the same `hsum256` and `tail`: bits identical
   to `block`'s at one row. A tile is 6 rows of W by 4 pairs (8 rows) of x: 24 accumulators,
   10 loads per 24 FMAs, so a window of many rows runs near the FMA units' rate rather than
   re-reading W once per 8 rows from memory. */

#define TGT512 __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define WROWS 6
#define PAIRS 4

static int wide_min_rows = 2; /* rows from which products take this form (0: never; `mtp_skinny_set_wide`) */
static int have_avx512 = -1;

static void pack_pairs(int M, int K8, const float *x, int ldx, float *xp) {
    for (int p = 0; p < (M + 1) / 2; p++)
        for (int k = 0; k < K8; k += 8) {
            float *d = xp + (size_t)p * 2 * K8 + 2 * k;
            for (int i = 0; i < 8; i++) {
                d[i] = x[(size_t)(2 * p) * ldx + k + i];
                d[8 + i] = 2 * p + 1 < M ? x[(size_t)(2 * p + 1) * ldx + k + i] : 0.0f;
            }
        }
}

/* R rows of W from n against P pairs of x: xp and x point at the tile's first pair / row,
   `rows` of x are real (2P, or 2P - 1 for the last pair of an odd M). */
TGT512 static inline __attribute__((always_inline)) void tile512(const int R, const int P, const int PF, long n, int K,
                                                                 const float *xp, const float *x, int ldx, int rows,
                                                                 const float *w, int ldw, float *out, int ldo) {
    __m512 acc[WROWS * PAIRS];
    for (int i = 0; i < R * P; i++) acc[i] = _mm512_setzero_ps();
    const int K8 = K & ~7;
    const size_t pair = (size_t)2 * K8;
    for (int k = 0; k < K8; k += 8) {
        __m512 xv[PAIRS];
        for (int p = 0; p < P; p++) xv[p] = _mm512_loadu_ps(xp + p * pair + 2 * k);
        if (PF && (k & 15) == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (size_t)(n + R + r) * ldw + k), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps(w + (size_t)(n + r) * ldw + k));
            for (int p = 0; p < P; p++) acc[r * P + p] = _mm512_fmadd_ps(xv[p], wv, acc[r * P + p]);
        }
    }
    for (int r = 0; r < R; r++) {
        const float *wr = w + (size_t)(n + r) * ldw;
        for (int p = 0; p < P; p++) {
            const int m = 2 * p;
            out[(size_t)m * ldo + n + r] = tail(hsum256(_mm512_castps512_ps256(acc[r * P + p])), x + (size_t)m * ldx, wr, K8, K);
            if (m + 1 < rows)
                out[(size_t)(m + 1) * ldo + n + r] =
                    tail(hsum256(_mm512_extractf32x8_ps(acc[r * P + p], 1)), x + (size_t)(m + 1) * ldx, wr, K8, K);
        }
    }
}

#define TILE(R, P, PF) tile512(R, P, PF, n, K, xp + (size_t)p0 * 2 * K8, x + (size_t)2 * p0 * ldx, ldx, rows, w, ldw, out + (size_t)2 * p0 * ldo, ldo)
#define TILES(R, PF)                                              \
    for (int p0 = 0; p0 < P; p0 += PAIRS) {                       \
        const int pc = P - p0 < PAIRS ? P - p0 : PAIRS;           \
        const int rows = M - 2 * p0 < 2 * pc ? M - 2 * p0 : 2 * pc; \
        if (PF && p0 == 0) {                                      \
            switch (pc) {                                         \
                case 1: TILE(R, 1, 1); break;                     \
                case 2: TILE(R, 2, 1); break;                     \
                case 3: TILE(R, 3, 1); break;                     \
                default: TILE(R, 4, 1); break;                    \
            }                                                     \
        } else {                                                  \
            switch (pc) {                                         \
                case 1: TILE(R, 1, 0); break;                     \
                case 2: TILE(R, 2, 0); break;                     \
                case 3: TILE(R, 3, 0); break;                     \
                default: TILE(R, 4, 0); break;                    \
            }                                                     \
        }                                                         \
    }

TGT512 static void span512(int M, long n0, long n1, int K, const float *xp, const float *x, int ldx, const float *w,
                           int ldw, float *out, int ldo) {
    const int P = (M + 1) / 2, K8 = K & ~7;
    long n = n0;
    for (; n + WROWS <= n1; n += WROWS) TILES(WROWS, 1)
    for (; n < n1; n++) TILES(1, 0)
}

/* ------------------------------------------------------------ thread pool */

typedef struct {
    int M, K, ldx, ldw, ldo, parts;
    long N;
    const float *x, *w, *xp; /* xp: x packed in pairs for span512, or NULL */
    float *out;
} job_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static job_t job;
static unsigned long generation;
static int pending, started;
static unsigned long first_job[MAX_THREADS]; /* a worker takes jobs published after it was created */

/* Rows [n0, n1) of W against all M rows of x, in whichever form the job was set up for. */
static void span_any(const job_t *j, long n0, long n1) {
    if (j->xp)
        span512(j->M, n0, n1, j->K, j->xp, j->x, j->ldx, j->w, j->ldw, j->out, j->ldo);
    else if (j->M <= MAX_ROWS)
        span(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->out, j->ldo);
    else
        span_rows(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->out, j->ldo);
}

static void part(const job_t *j, int p) {
    const long unit = j->xp ? WROWS : 1; /* the wide form: whole tiles in each part */
    long blocks = (j->N + unit - 1) / unit;
    long n0 = blocks * p / j->parts * unit, n1 = blocks * (p + 1) / j->parts * unit;
    span_any(j, n0, n1 < j->N ? n1 : j->N);
}

static void *worker(void *arg) {
    int p = (int)(intptr_t)arg;
    unsigned long seen = first_job[p];
    for (;;) {
        pthread_mutex_lock(&lock);
        while (generation == seen) pthread_cond_wait(&wake, &lock);
        seen = generation;
        job_t j = job;
        pthread_mutex_unlock(&lock);
        if (p < j.parts) part(&j, p);
        pthread_mutex_lock(&lock);
        if (--pending == 0) pthread_cond_signal(&done);
        pthread_mutex_unlock(&lock);
    }
    return NULL;
}

static int start_pool(void) { /* under call_lock: no job is being published */
    for (int p = started + 1; p < n_threads; p++) {
        pthread_t t;
        first_job[p] = generation;
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)p) != 0) break;
        pthread_detach(t);
        started = p;
    }
    return started + 1;
}

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one parallel product at a time */

static __thread float *pack_buf; /* the caller's x in pairs; grows, never shrinks */
static __thread size_t pack_len;

static void skinny(int M, long N, int K, const float *x, int ldx, const float *w, int ldw, float *out, int ldo) {
    job_t j = {M, K, ldx, ldw, ldo, 1, N, x, w, NULL, out};
    if (have_avx512 && wide_min_rows && M >= wide_min_rows && K >= 8) {
        size_t need = (size_t)(M + 1) / 2 * 2 * (size_t)(K & ~7);
        if (need > pack_len) {
            free(pack_buf);
            pack_buf = aligned_alloc(64, (need * sizeof(float) + 63) & ~(size_t)63);
            pack_len = pack_buf ? need : 0;
        }
        if (pack_buf) {
            pack_pairs(M, K & ~7, x, ldx, pack_buf);
            j.xp = pack_buf;
        }
    }
    if (n_threads <= 1 || N * (long)K < thread_min || pthread_mutex_trylock(&call_lock) != 0) {
        span_any(&j, 0, N);
        return;
    }
    int workers = start_pool();
    j.parts = workers < n_threads ? workers : n_threads;
    pthread_mutex_lock(&lock);
    job = j;
    pending = started;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    part(&j, 0);
    pthread_mutex_lock(&lock);
    while (pending > 0) pthread_cond_wait(&done, &lock);
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&call_lock);
}

/* ------------------------------------------------- small products, any rows

   The products under `small_max` (W in cache, 4 MB) with at most SMALL_MAX_ROWS rows,
   that the kernel above did not take:
   attention's q.k and p.v, the small weights of tiny models, the gates. OpenBLAS
   gives a row of such a product different bits at 1 row and at 4 (row 0 of a
   40 x 32 product: 1.7e-6 apart), so a verify window's attention differed from T
   single steps; with int8 decode numerics that flipped a rounding step of x and
   then tokens. Here every output element is computed by one fixed sequence of
   operations that depends on neither M nor the row's place among the others:
   - B transposed (y = A B^T, B [N, K]): the skinny kernel above, 8 rows of A at a time;
   - B not transposed (y = A B, B [K, N]): an FMA chain over k in order for each
     output, 8 outputs of a row per vector (a scalar fmaf rounds as a vector lane,
     so the tail columns agree too);
   - A transposed: its row is first copied out contiguous;
   - alpha / beta other than 1 / 0: out = alpha * s + beta * C, in that order. */

#define SMALL_MAX_ROWS 64
static int small_on = 1; /* `mtp_skinny_set_small` */
static long small_max = 1L << 20; /* elements of W below which products go here (`mtp_skinny_set_small`), whatever
                                     `skinny_min` is: calibration may hand the large ones back to OpenBLAS */
static long small_calls;

/* One row of A (contiguous, K values) against B [K, N] (row stride ldb): out[0..N). */
TGT static void row_times_b(int N, int K, const float *a, const float *b, int ldb, float *out) {
    int n = 0;
    for (; n + 32 <= N; n += 32) {
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        for (int k = 0; k < K; k++) {
            const float *bk = b + (size_t)k * ldb + n;
            __m256 av = _mm256_set1_ps(a[k]);
            c0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(bk), c0);
            c1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(bk + 8), c1);
            c2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(bk + 16), c2);
            c3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(bk + 24), c3);
        }
        _mm256_storeu_ps(out + n, c0);
        _mm256_storeu_ps(out + n + 8, c1);
        _mm256_storeu_ps(out + n + 16, c2);
        _mm256_storeu_ps(out + n + 24, c3);
    }
    for (; n + 8 <= N; n += 8) {
        __m256 c0 = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) c0 = _mm256_fmadd_ps(_mm256_set1_ps(a[k]), _mm256_loadu_ps(b + (size_t)k * ldb + n), c0);
        _mm256_storeu_ps(out + n, c0);
    }
    for (; n < N; n++) {
        float c = 0.0f;
        for (int k = 0; k < K; k++) c = __builtin_fmaf(a[k], b[(size_t)k * ldb + n], c);
        out[n] = c;
    }
}

/* Four rows of A at once (a[r], contiguous) against B [K, N]: each load of B serves the four
   rows; every output is still the same FMA chain over k in order as in row_times_b. */
TGT static void rows4_times_b(int N, int K, const float *const a[4], const float *b, int ldb, float *const out[4]) {
    int n = 0;
    for (; n + 16 <= N; n += 16) {
        __m256 c[4][2];
        for (int r = 0; r < 4; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            const float *bk = b + (size_t)k * ldb + n;
            __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8);
            for (int r = 0; r < 4; r++) {
                __m256 av = _mm256_set1_ps(a[r][k]);
                c[r][0] = _mm256_fmadd_ps(av, b0, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(av, b1, c[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(out[r] + n, c[r][0]);
            _mm256_storeu_ps(out[r] + n + 8, c[r][1]);
        }
    }
    if (n < N)
        for (int r = 0; r < 4; r++) row_times_b(N - n, K, a[r], b + n, ldb, out[r] + n);
}

TGT static void small_product(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                              const float *B, int ldb, float beta, float *C, int ldc) {
    float stack_row[1024], stack_out[1024];
    float *row = K <= 1024 ? stack_row : malloc(sizeof(float) * (size_t)K);
    float *tmp = N <= 1024 ? stack_out : malloc(sizeof(float) * (size_t)N);
    const int direct = alpha == 1.0f && beta == 0.0f;
    if (direct && trans_a == NO_TRANS && trans_b == TRANS && K >= 8) { /* the common case: the rows share B's loads */
        skinny(M, N, K, A, lda, B, ldb, C, ldc);
        M = 0; /* done */
    }
    if (direct && trans_a == NO_TRANS && trans_b == NO_TRANS) {
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *a[4] = {A + (size_t)m * lda, A + (size_t)(m + 1) * lda, A + (size_t)(m + 2) * lda,
                                 A + (size_t)(m + 3) * lda};
            float *o[4] = {C + (size_t)m * ldc, C + (size_t)(m + 1) * ldc, C + (size_t)(m + 2) * ldc,
                           C + (size_t)(m + 3) * ldc};
            rows4_times_b(N, K, a, B, ldb, o);
        }
        for (; m < M; m++) row_times_b(N, K, A + (size_t)m * lda, B, ldb, C + (size_t)m * ldc);
        M = 0; /* done */
    }
    for (int m = 0; m < M; m++) {
        const float *a = A + (size_t)m * lda;
        if (trans_a == TRANS) {
            for (int k = 0; k < K; k++) row[k] = A[(size_t)k * lda + m];
            a = row;
        }
        float *out = direct ? C + (size_t)m * ldc : tmp;
        if (trans_b == TRANS) {
            if (K >= 8) {
                span(1, 0, N, K, a, K, B, ldb, out, N);
            } else {
                for (int n = 0; n < N; n++) {
                    float s = 0.0f;
                    for (int k = 0; k < K; k++) s += a[k] * B[(size_t)n * ldb + k];
                    out[n] = s;
                }
            }
        } else {
            row_times_b(N, K, a, B, ldb, out);
        }
        if (!direct) {
            float *c = C + (size_t)m * ldc;
            for (int n = 0; n < N; n++) c[n] = beta == 0.0f ? alpha * tmp[n] : alpha * tmp[n] + beta * c[n];
        }
    }
    if (row != stack_row) free(row);
    if (tmp != stack_out) free(tmp);
}

/* ------------------------------------------------------------- interface */

int mtp_skinny_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    static int supported = -1; /* loaded into the global scope before anyone could check: check here */
    if (supported < 0) supported = mtp_skinny_supported();
    if (have_avx512 < 0) {
        __builtin_cpu_init();
        have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    }
    if (supported && order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && M >= 1 && M <= skinny_max_rows &&
        K >= 8 && (long)N * K >= skinny_min && alpha == 1.0f && beta == 0.0f) {
        __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
        skinny(M, N, K, A, lda, B, ldb, C, ldc);
        return;
    }
    if (supported && small_on && order == ROW_MAJOR && M >= 1 && M <= SMALL_MAX_ROWS && (long)N * K < small_max &&
        (trans_a == NO_TRANS || trans_a == TRANS) && (trans_b == NO_TRANS || trans_b == TRANS) && N <= 1024 * 1024) {
        __atomic_add_fetch(&small_calls, 1, __ATOMIC_RELAXED);
        small_product(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (fallback == NULL) fallback = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm"); /* no OpenBLAS attached */
    fallback(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void mtp_skinny_set_fallback(sgemm_fn fn) { fallback = fn; }

void mtp_skinny_set_threads(int n) {
    pthread_mutex_lock(&call_lock);
    n_threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    pthread_mutex_unlock(&call_lock);
}

void mtp_skinny_set_min(long elements) { skinny_min = elements; }

void mtp_skinny_set_max_rows(int rows) { skinny_max_rows = rows < 1 ? 1 : rows > 64 ? 64 : rows; }

long mtp_skinny_calls(void) { return __atomic_load_n(&calls, __ATOMIC_RELAXED); }

void mtp_skinny_set_small(int on, long max_elements) {
    small_on = on;
    small_max = max_elements;
}

int mtp_skinny_small_on(void) { return small_on; }

/* Products of `min_rows` rows or more on the AVX-512 form (0: none, every product on `span` /
   `span_rows`); returns whether the CPU has AVX-512 at all. */
int mtp_skinny_set_wide(int min_rows) {
    wide_min_rows = min_rows;
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    return have_avx512;
}

long mtp_skinny_small_calls(void) { return __atomic_load_n(&small_calls, __ATOMIC_RELAXED); }

/* ------------------------------------------------------------ peak, measured

   Multiply-adds per second one thread can issue (independent FMA chains, registers only), on
   the widest form the kernels above use: the ceiling benchmarks hold the kernels' rate against. */

TGT512 static double peak512(long iters, float seed) {
    __m512 a[24], x = _mm512_set1_ps(1.0f + seed * 1e-7f), y = _mm512_set1_ps(seed);
    for (int i = 0; i < 24; i++) a[i] = _mm512_set1_ps((float)i);
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
    }
    float s = 0.0f;
    for (int i = 0; i < 24; i++) s += _mm512_reduce_add_ps(a[i]);
    return s;
}

TGT static double peak256(long iters, float seed) {
    __m256 a[12], x = _mm256_set1_ps(1.0f + seed * 1e-7f), y = _mm256_set1_ps(seed);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
    }
    float s = 0.0f;
    for (int i = 0; i < 12; i++) s += hsum256(a[i]);
    return s;
}

#include <time.h>

/* Multiply-adds (lanes) per second of `iters` rounds on the calling thread. */
double mtp_skinny_peak_fma(long iters) {
    struct timespec t0, t1;
    volatile double sink;
    mtp_skinny_set_wide(wide_min_rows);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    sink = have_avx512 ? peak512(iters, 0.5f) : peak256(iters, 0.5f);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    (void)sink;
    double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    return (double)iters * (have_avx512 ? 24 * 16 : 12 * 8) / s;
}
