/* moekit's native CPU kernels (compiled on first use by moekit/native/__init__.py).
 *
 * moekit_int8_gemv_experts: a decode token's int8 products over its experts in one call,
 *
 *     out[i, r] = sum_k w[experts[i], r, k] * x[i * x_stride + k]     (exact int32)
 *
 * for i < n slots and r < N output rows, w int8 [E, N, K] contiguous, x int8 rows (x_stride 0:
 * one row shared by every slot). One OpenMP loop covers every slot's rows in blocks of ROWS,
 * so the weights of all the token's experts stream under one parallel region, and each row
 * group prefetches the rows PREFETCH_ROWS ahead of it: at one token the products are bound by
 * how many weight lines are in flight, not by arithmetic. x is widened to int16 once and
 * multiplied by sign-extended weights into int32 lanes (pairs of products of at most 127 * 127
 * each), exact for K below 2^31 / 127^2.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define ROWS 32          /* rows of one work item */
#define PREFETCH_ROWS 8  /* how far ahead a row group prefetches */

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MOEKIT_ISA "avx512_vnni"
#elif defined(__AVX512BW__)
#define MOEKIT_ISA "avx512"
#elif defined(__AVX2__)
#define MOEKIT_ISA "avx2"
#else
#define MOEKIT_ISA "scalar"
#endif

const char *moekit_isa(void) { return MOEKIT_ISA; }

int moekit_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline int32_t dot_tail(const int8_t *w, const int16_t *x, int64_t k0, int64_t K) {
    int32_t acc = 0;
    for (int64_t k = k0; k < K; k++) acc += (int32_t)w[k] * x[k];
    return acc;
}

#if defined(__AVX512BW__)
#define STEP 32
typedef __m512i vacc;
static inline vacc vzero(void) { return _mm512_setzero_si512(); }
static inline vacc vload_x(const int16_t *x) { return _mm512_loadu_si512((const void *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w16, xv);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w16, xv));
#endif
}
static inline int32_t vsum(vacc a) { return _mm512_reduce_add_epi32(a); }
#elif defined(__AVX2__)
#define STEP 16
typedef __m256i vacc;
static inline vacc vzero(void) { return _mm256_setzero_si256(); }
static inline vacc vload_x(const int16_t *x) { return _mm256_loadu_si256((const __m256i *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, xv));
}
static inline int32_t vsum(vacc a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

#ifdef STEP
static inline void prefetch_line(const int8_t *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* Four rows w[0..3] (row stride K) against x; prefetches the four rows PREFETCH_ROWS ahead. */
static inline void rows4(const int8_t *w, int64_t K, const int16_t *x, int32_t *out) {
    const int64_t kv = K - K % STEP;
    const int8_t *ahead = w + PREFETCH_ROWS * K;
    vacc a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t k = 0; k < kv; k += STEP) {
        if ((k & 63) == 0) {
            prefetch_line(ahead + k);
            prefetch_line(ahead + K + k);
            prefetch_line(ahead + 2 * K + k);
            prefetch_line(ahead + 3 * K + k);
        }
        vacc xv = vload_x(x + k);
        a0 = vmadd(a0, w + k, xv);
        a1 = vmadd(a1, w + K + k, xv);
        a2 = vmadd(a2, w + 2 * K + k, xv);
        a3 = vmadd(a3, w + 3 * K + k, xv);
    }
    out[0] = vsum(a0) + dot_tail(w, x, kv, K);
    out[1] = vsum(a1) + dot_tail(w + K, x, kv, K);
    out[2] = vsum(a2) + dot_tail(w + 2 * K, x, kv, K);
    out[3] = vsum(a3) + dot_tail(w + 3 * K, x, kv, K);
}

static inline int32_t row1(const int8_t *w, int64_t K, const int16_t *x) {
    const int64_t kv = K - K % STEP;
    vacc a = vzero();
    for (int64_t k = 0; k < kv; k += STEP) a = vmadd(a, w + k, vload_x(x + k));
    return vsum(a) + dot_tail(w, x, kv, K);
}
#else
static inline void rows4(const int8_t *w, int64_t K, const int16_t *x, int32_t *out) {
    for (int j = 0; j < 4; j++) out[j] = dot_tail(w + j * K, x, 0, K);
}
static inline int32_t row1(const int8_t *w, int64_t K, const int16_t *x) { return dot_tail(w, x, 0, K); }
#endif

/* Returns 0, or 1 when the scratch for the widened x cannot be allocated. */
int moekit_int8_gemv_experts(const int8_t *w, const int64_t *experts, int64_t n, const int8_t *x,
                             int64_t x_stride, int64_t N, int64_t K, int32_t *out, int threads) {
    const int64_t x_rows = x_stride ? n : 1;
    int16_t *x16 = (int16_t *)malloc((size_t)(x_rows * K) * sizeof(int16_t));
    if (x16 == NULL) return 1;
    for (int64_t i = 0; i < x_rows; i++)
        for (int64_t k = 0; k < K; k++) x16[i * K + k] = x[i * x_stride + k];
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t item = 0; item < n * blocks; item++) {
        const int64_t i = item / blocks, r0 = (item % blocks) * ROWS;
        const int64_t r1 = r0 + ROWS < N ? r0 + ROWS : N;
        const int8_t *wi = w + experts[i] * N * K;
        const int16_t *xi = x16 + (x_stride ? i * K : 0);
        int32_t *oi = out + i * N;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4) rows4(wi + r * K, K, xi, oi + r);
        for (; r < r1; r++) oi[r] = row1(wi + r * K, K, xi);
    }
    free(x16);
    (void)threads;
    return 0;
}
