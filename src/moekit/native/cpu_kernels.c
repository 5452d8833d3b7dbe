/* moekit's native CPU kernels (compiled on first use by moekit/native/__init__.py): int8,
 * weight-only int4 / int8 and float products of rows grouped by expert, and a decode token's
 * whole FFN on them in one parallel region (moekit_decode, at the end).
 *
 * moekit_int8_gemm_segments: int8 products of rows grouped by expert, in one call,
 *
 *     out[j, r] = sum_k w[experts[s], r, k] * x[j * x_stride + k]     (exact int32)
 *
 * for the rows j of each segment s (starts[s] <= j < starts[s + 1]; starts NULL: segment s is
 * row s, a decode token's slots) and r < N output rows; w int8 [E, N, K] contiguous, x int8
 * rows (x_stride 0: one row shared by every segment). One OpenMP loop covers every segment's
 * weight rows in blocks of ROWS, so the weights of all the experts stream under one parallel
 * region, each weight row once, and each row (group) prefetches the weights ahead of it: with
 * few rows an expert the products are bound by how many weight lines are in flight, not by
 * arithmetic. The products are exact int32 sums (see xq_t below for how each instruction set
 * forms them).
 *
 * Row order: a segment of one x row (a decode) takes MOEKIT_ROW_GROUP weight rows a pass, one of
 * several x rows MOEKIT_ROW_GROUP_MANY. Four rows a pass share x's loads, the rows PREFETCH_ROWS
 * ahead prefetched (measured on an Intel Xeon, where the bf16 decode streams at 93 % of the read
 * floor); one row after another prefetches the bytes ROW_AHEAD ahead: four rows a pass read four
 * interleaved streams of one row (0.5-2 KB) each, which AMD's hardware prefetchers follow badly
 * (Zen 3: one row at a time took the decode from 1.00 to 0.74x (int8), 0.80x (bf16) and 0.89x
 * (int4); Zen 5: 0.77x, 0.77x and 1.03-1.05x, the int4 rows later 0.84x on vnni_whole_impl,
 * bench/NOTES-cpu.md). Several x rows read each
 * weight row from L1 once per x row, so there four rows a pass win where the four-row kernels
 * are AVX-512 ones (Zen 5, 16 rows an expert: bf16 1.58x, int4 1.27x faster than one row).
 * Defaults: MOEKIT_ROW_GROUP 4 on AVX-512 builds, 1 on the others (the library builds with 1 on
 * AMD CPUs); MOEKIT_ROW_GROUP_MANY 4 on AVX-512 builds, MOEKIT_ROW_GROUP on the others. -D
 * overrides either (the test builds run both orders).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* vpdpbusd on zmm accumulators, in place. GCC 12 expands the intrinsic with a copy of every
 * accumulator into a new register (and, with 16 of them, stack spills) around each product: a
 * 4 x 4 block of int8 products ran at 183-295 GMAC/s a core that way, 387 with the accumulator
 * as an in-out operand; sorted int8 calls of 8 rows an expert 0.83x, 32 rows 0.97x (AMD Zen 5,
 * bench/NOTES-cpu.md). (The same for vdpbf16ps made the bf16 kernels 1.1-1.4x slower: not used.) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512i dpbusd512(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "vm"(s8));
    return acc;
}
/* The same with both operands in registers (operands loaded once for several products: GCC
 * otherwise folds a load into every product that uses it). */
static inline __m512i dpbusd512r(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}
#endif

/* The loops of a parallel region, split statically over its threads (a loop in a row). */
#ifdef _OPENMP
#define OMP_FOR _Pragma("omp for schedule(static)")
#define OMP_FOR_DYNAMIC _Pragma("omp for schedule(dynamic, 1)")
#else
#define OMP_FOR
#define OMP_FOR_DYNAMIC
#endif

#define ROWS 32          /* rows of one work item */
#define PREFETCH_ROWS 8  /* how far ahead a four-row group prefetches */
#define ROW_AHEAD 4096   /* how many bytes ahead a row prefetches when rows go one at a time */
#ifndef MOEKIT_ROW_GROUP
#if defined(__AVX512F__)
#define MOEKIT_ROW_GROUP 4
#else
#define MOEKIT_ROW_GROUP 1
#endif
#endif
#ifndef MOEKIT_ROW_GROUP_MANY
#if defined(__AVX512F__)
#define MOEKIT_ROW_GROUP_MANY 4
#else
#define MOEKIT_ROW_GROUP_MANY MOEKIT_ROW_GROUP
#endif
#endif
#if (MOEKIT_ROW_GROUP != 1 && MOEKIT_ROW_GROUP != 4) || (MOEKIT_ROW_GROUP_MANY != 1 && MOEKIT_ROW_GROUP_MANY != 4)
#error "MOEKIT_ROW_GROUP and MOEKIT_ROW_GROUP_MANY must be 1 or 4"
#endif
#define FOUR_ROWS (MOEKIT_ROW_GROUP == 4 || MOEKIT_ROW_GROUP_MANY == 4)  /* a build with four-row passes */
#ifndef MANY_X_ROWS
#define MANY_X_ROWS 4  /* the x rows from which a segment has "several" */
#endif
/* whether a segment of x_rows x rows takes four weight rows a pass */
#define FOUR_A_PASS(x_rows) (((x_rows) >= MANY_X_ROWS ? MOEKIT_ROW_GROUP_MANY : MOEKIT_ROW_GROUP) == 4)

/* Rows one at a time: the weight bytes ROW_AHEAD past a row of row_bytes, into L1. */
static inline void prefetch_row_ahead(const void *row, int64_t row_bytes) {
#if (defined(__AVX2__) || defined(__AVX512F__)) && (MOEKIT_ROW_GROUP == 1 || MOEKIT_ROW_GROUP_MANY == 1)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)row + ROW_AHEAD + b, _MM_HINT_T0);
#else
    (void)row, (void)row_bytes;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MOEKIT_ISA "avx512_vnni"
#elif defined(__AVX512BW__)
#define MOEKIT_ISA "avx512"
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define MOEKIT_ISA "avx2_vnni"
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

/* x rows of the int8 products: with VNNI (AVX-512 or AVX-VNNI) int8, multiplied by vpdpbusd
 * against the weights as unsigned bytes w + 128 (an xor), so a row's products are
 * sum (w + 128) x - 128 sum x, exact; with AVX2 alone int8 too, multiplied by vpmaddubsw as
 * |w| times x with w's sign (I8_SIGN below); else widened to int16 once and multiplied by
 * sign-extended weights into int32 lanes (pmaddwd). */
#if (defined(__AVX512BW__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && defined(__AVXVNNI__))
#define XQ_OFFSET 128
typedef int8_t xq_t;
#elif defined(__AVX2__) && !defined(__AVX512BW__)
#define XQ_OFFSET 0
#define I8_SIGN 1
typedef int8_t xq_t;
#else
#define XQ_OFFSET 0
typedef int16_t xq_t;
#endif

static inline int32_t dot_tail(const int8_t *w, const xq_t *x, int64_t k0, int64_t K) {
    int32_t acc = 0;
    for (int64_t k = k0; k < K; k++) acc += (int32_t)w[k] * x[k];
    return acc;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define STEP 64
typedef __m512i vacc;
static inline vacc vzero(void) { return _mm512_setzero_si512(); }
static inline vacc vload_x(const xq_t *x) { return _mm512_loadu_si512((const void *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)w), _mm512_set1_epi8((char)0x80));
    return dpbusd512(acc, wu, xv);
}
static inline int32_t vsum(vacc a) { return _mm512_reduce_add_epi32(a); }
#elif defined(__AVX512BW__)
#define STEP 32
typedef __m512i vacc;
static inline vacc vzero(void) { return _mm512_setzero_si512(); }
static inline vacc vload_x(const xq_t *x) { return _mm512_loadu_si512((const void *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w16, xv));
}
static inline int32_t vsum(vacc a) { return _mm512_reduce_add_epi32(a); }
#elif defined(__AVX2__)
typedef __m256i vacc;
static inline vacc vzero(void) { return _mm256_setzero_si256(); }
static inline vacc vload_x(const xq_t *x) { return _mm256_loadu_si256((const __m256i *)x); }
#if defined(__AVXVNNI__)
#define STEP 32
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w), _mm256_set1_epi8((char)0x80));
    return _mm256_dpbusd_avx_epi32(acc, wu, xv);
}
#else
/* I8_SIGN: vpmaddubsw multiplies |w| (unsigned, at most 128) by x with w's sign (vpsignb: -x
 * where w < 0, 0 where w = 0), adjacent pairs summed into int16: at most 2 * 128 * 127 = 32512
 * while |x| <= 127, so nothing saturates, and vpmaddwd by ones sums the pairs into the int32
 * lanes: 5 instructions a 32 weights against 6 that widen them (1.5x with the weights in
 * cache; the decode, bound by the weight stream, measured the same). Exact
 * unless x holds -128 (its sign flip wraps), which the quantized rows never do; calls with raw
 * int8 rows holding -128 take the scalar products (int8_call.scalar). */
#define STEP 32
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
static inline int32_t vsum(vacc a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* The sum of x over the columns the vector loops take (those below K - K % STEP): the offset
 * the VNNI products subtract (128 of it). */
static inline int32_t xq_vector_sum(const xq_t *x, int64_t K) {
    int32_t t = 0;
#if XQ_OFFSET
    for (int64_t k = 0; k < K - K % STEP; k++) t += x[k];
#else
    (void)x, (void)K;
#endif
    return t;
}

#ifdef STEP
static inline void prefetch_line(const int8_t *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* A row's product from its vector lanes' sum, x's vector sum and the tail: modulo 2^32 (the
 * lanes wrap the same way), so exact wherever the product itself fits int32. */
static inline int32_t combine(int32_t lanes, int32_t xs, int32_t tail) {
    return (int32_t)((uint32_t)lanes - (uint32_t)XQ_OFFSET * (uint32_t)xs + (uint32_t)tail);
}

/* Four rows w[0..3] (row stride K) against x (xs = xq_vector_sum(x)); prefetches the four rows
 * PREFETCH_ROWS ahead. */
static inline void rows4(const int8_t *w, int64_t K, const xq_t *x, int32_t xs, int32_t *out) {
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
    out[0] = combine(vsum(a0), xs, dot_tail(w, x, kv, K));
    out[1] = combine(vsum(a1), xs, dot_tail(w + K, x, kv, K));
    out[2] = combine(vsum(a2), xs, dot_tail(w + 2 * K, x, kv, K));
    out[3] = combine(vsum(a3), xs, dot_tail(w + 3 * K, x, kv, K));
}

static inline int32_t row1(const int8_t *w, int64_t K, const xq_t *x, int32_t xs) {
    const int64_t kv = K - K % STEP;
    vacc a = vzero();
    for (int64_t k = 0; k < kv; k += STEP) a = vmadd(a, w + k, vload_x(x + k));
    return combine(vsum(a), xs, dot_tail(w, x, kv, K));
}

#ifdef __AVX512F__
/* The 4 sums of 4 accumulators, [s0, s1, s2, s3]. */
static inline __m128 sum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_4X4 1
/* The sums of four int32 accumulators' lanes, [s0, s1, s2, s3]. */
static inline __m128i sum4x16i(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i b0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i b1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(b0, b1), _mm512_unpackhi_epi64(b0, b1));
    const __m256i d = _mm256_add_epi32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
}

/* Four rows w[0..3] (row stride K) against four x rows (stride K; their vector sums xs):
 * out[j][r]. Each weight vector is flipped to unsigned once for the four x rows, and the 16
 * accumulators' lanes are summed by one transpose-add a x row (named, not an array: GCC kept
 * an array's sums moving between registers and the stack every step). */
static void rows4x4(const int8_t *w, int64_t K, const xq_t *x, const int32_t *xs, int32_t out[4][4]) {
    const int64_t kv = K - K % STEP;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const int8_t *ahead = w + PREFETCH_ROWS * K;
    for (int64_t k = 0; k < kv; k += STEP) {
        for (int r = 0; r < 4; r++) prefetch_line(ahead + r * K + k);  /* as rows4 */
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + k)), flip);
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + K + k)), flip);
        const __m512i w2 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 2 * K + k)), flip);
        const __m512i w3 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 3 * K + k)), flip);
#define X4(J, A0, A1, A2, A3)                                                              \
        {                                                                                  \
            const __m512i xv = _mm512_loadu_si512((const void *)(x + (J) * K + k));        \
            A0 = dpbusd512(A0, w0, xv), A1 = dpbusd512(A1, w1, xv);    \
            A2 = dpbusd512(A2, w2, xv), A3 = dpbusd512(A3, w3, xv);    \
        }
        X4(0, a00, a10, a20, a30)
        X4(1, a01, a11, a21, a31)
        X4(2, a02, a12, a22, a32)
        X4(3, a03, a13, a23, a33)
#undef X4
    }
    const __m128i s[4] = {sum4x16i(a00, a10, a20, a30), sum4x16i(a01, a11, a21, a31), sum4x16i(a02, a12, a22, a32),
                          sum4x16i(a03, a13, a23, a33)};
    for (int j = 0; j < 4; j++) {
        int32_t lanes[4];
        _mm_storeu_si128((__m128i *)lanes, s[j]);
        for (int r = 0; r < 4; r++) out[j][r] = combine(lanes[r], xs[j], dot_tail(w + r * K, x + j * K, kv, K));
    }
}
#endif
#else
static inline void rows4(const int8_t *w, int64_t K, const xq_t *x, int32_t xs, int32_t *out) {
    (void)xs;
    for (int j = 0; j < 4; j++) out[j] = dot_tail(w + j * K, x, 0, K);
}
static inline int32_t row1(const int8_t *w, int64_t K, const xq_t *x, int32_t xs) {
    (void)xs;
    return dot_tail(w, x, 0, K);
}
#endif

/* Rows of segment s: [starts[s], starts[s + 1]), or the one row s when starts is NULL. */
static inline int64_t seg_begin(const int64_t *starts, int64_t s) { return starts ? starts[s] : s; }

/* Work item `item` of a kernel's parallel loop (blocks of ROWS weight rows per segment): its
 * segment s, weight rows [r0, r1) and x / output rows [j0, j1). */
typedef struct { int64_t s, r0, r1, j0, j1; } work_item;
static inline work_item item_of(int64_t item, int64_t blocks, const int64_t *starts, int64_t N) {
    work_item it;
    it.s = item / blocks;
    it.r0 = (item % blocks) * ROWS;
    it.r1 = it.r0 + ROWS < N ? it.r0 + ROWS : N;
    it.j0 = seg_begin(starts, it.s);
    it.j1 = seg_begin(starts, it.s + 1);
    return it;
}

/* x_f32 row xj [K] fp32 -> xq: the int8 quantization of one row (*xsum: its xq_vector_sum), as
 * moekit.quant.quantize_activation's "token" granularity does it: s = amax / 127 (1 where that
 * is not > 0), q = round half to even (x / s), clamped to [-127, 127]; *scale = s. */
static void quantize_row(const float *xj, int64_t K, xq_t *xq, float *scale, int32_t *xsum) {
    float amax = 0.0f;
    int nan = 0;
    for (int64_t k = 0; k < K; k++) {
        const float a = fabsf(xj[k]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float s = nan ? NAN : amax / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    *scale = s;
    int64_t k = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    /* the same division, rounding (half to even) and clamp on 16 lanes; NaN converts to
     * INT_MIN and truncates to 0 as the scalar conversion does */
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; k + 16 <= K; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xj + k), sv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));  /* NaN passes (the second operand) */
        _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
    }
#endif
    for (; k < K; k++) {
        float q = nearbyintf(xj[k] / s);
        q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
        xq[k] = (xq_t)q;
    }
    *xsum = xq_vector_sum(xq, K);
}

/* One int8 product call: its weights, segments, prepared x rows (xq [rows or 1, K], their
 * xq_vector_sums and scales) and output (int32 out, or fp32 out_f32 rescaled by w_scale [E, N]). */
typedef struct {
    const int8_t *w;
    const int64_t *experts, *starts;
    const xq_t *xq;
    const int32_t *xsum;
    const float *scales, *w_scale;
    int shared;  /* one x row for every segment */
    int64_t N, K, blocks;
    int32_t *out;
    float *out_f32;
    int scalar;  /* I8_SIGN builds: raw x rows hold -128, every product runs scalar */
} int8_call;

/* Work item `item` (a segment's block of ROWS weight rows) of an int8 call. */
static void int8_item(const int8_call *c, int64_t item) {
    const int64_t N = c->N, K = c->K;
    const work_item it = item_of(item, c->blocks, c->starts, N);
    const int8_t *ws = c->w + c->experts[it.s] * N * K;
    const float *sw = c->out_f32 ? c->w_scale + c->experts[it.s] * N : NULL;
    int64_t r = it.r0;
    if (c->scalar) {
        for (; r < it.r1; r++)
            for (int64_t j = it.j0; j < it.j1; j++)
                c->out[j * N + r] = dot_tail(ws + r * K, c->xq + (c->shared ? 0 : j * K), 0, K);
        return;
    }
#if FOUR_ROWS
    int32_t acc[4];
    if (FOUR_A_PASS(it.j1 - it.j0))
    for (; r + 4 <= it.r1; r += 4) {  /* four weight rows stay in L1 across the segment's x rows */
        int64_t j = it.j0;
#ifdef INT8_4X4
        if (!c->shared && it.j1 - it.j0 >= 8)  /* (at 4 x rows an expert: 1.16-1.21x slower than rows4) */
            for (; j + 4 <= it.j1; j += 4) {  /* four x rows at a time */
                int32_t o[4][4];
                rows4x4(ws + r * K, K, c->xq + j * K, c->xsum + j, o);
                for (int jj = 0; jj < 4; jj++) {
                    if (!c->out_f32) {
                        memcpy(c->out + (j + jj) * N + r, o[jj], sizeof o[jj]);
                        continue;
                    }
                    const float sx = c->scales[j + jj];
                    for (int i = 0; i < 4; i++) c->out_f32[(j + jj) * N + r + i] = ((float)o[jj][i] * sx) * sw[r + i];
                }
            }
#endif
        for (; j < it.j1; j++) {
            const xq_t *xj = c->xq + (c->shared ? 0 : j * K);
            const int32_t xs = c->xsum[c->shared ? 0 : j];
            if (!c->out_f32) {
                rows4(ws + r * K, K, xj, xs, c->out + j * N + r);
                continue;
            }
            rows4(ws + r * K, K, xj, xs, acc);
            const float sx = c->scales[c->shared ? 0 : j];
            for (int i = 0; i < 4; i++) c->out_f32[j * N + r + i] = ((float)acc[i] * sx) * sw[r + i];
        }
    }
#endif
    for (; r < it.r1; r++) {  /* the weight row stays in L1 across the segment's x rows */
        prefetch_row_ahead(ws + r * K, K);
        for (int64_t j = it.j0; j < it.j1; j++) {
            const int32_t a = row1(ws + r * K, K, c->xq + (c->shared ? 0 : j * K), c->xsum[c->shared ? 0 : j]);
            if (c->out_f32) c->out_f32[j * N + r] = ((float)a * c->scales[c->shared ? 0 : j]) * sw[r];
            else c->out[j * N + r] = a;
        }
    }
}

/* x_int8 (or, when x_f32 is given, x_f32 quantized per row into scales) against w, into out
 * int32; or, with x_f32, w_scale [E, N] and out_f32, rescaled there as the backend does it:
 * (float(acc) * s_x) * s_w. Returns 0, or 1 when the scratch for the widened x cannot be
 * allocated. */
int moekit_int8_gemm_segments(const int8_t *w, const int64_t *experts, const int64_t *starts, int64_t segments,
                              const int8_t *x, const float *x_f32, float *scales, int64_t x_stride, int64_t N,
                              int64_t K, int32_t *out, const float *w_scale, float *out_f32, int threads) {
    const int64_t rows = seg_begin(starts, segments), x_rows = x_stride ? rows : 1;
    int32_t *xsum = (int32_t *)malloc((size_t)x_rows * sizeof(int32_t) + (size_t)(x_rows * K) * sizeof(xq_t));
    if (xsum == NULL) return 1;
    xq_t *xq = (xq_t *)(xsum + x_rows);
    int scalar = 0;
    if (x_f32 != NULL) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (x_rows > 16)
#endif
        for (int64_t j = 0; j < x_rows; j++)  /* row by row: each its own scale */
            quantize_row(x_f32 + j * x_stride, K, xq + j * K, scales + j, xsum + j);
    } else
        for (int64_t j = 0; j < x_rows; j++) {
            for (int64_t k = 0; k < K; k++) {
                xq[j * K + k] = x[j * x_stride + k];
#ifdef I8_SIGN
                scalar |= x[j * x_stride + k] == -128;
#endif
            }
            xsum[j] = xq_vector_sum(xq + j * K, K);
        }
    const int8_call c = {w, experts, starts, xq, xsum, scales, w_scale, x_stride == 0, N, K, (N + ROWS - 1) / ROWS,
                         out, out_f32, scalar};
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t item = 0; item < segments * c.blocks; item++) int8_item(&c, item);
    free(xsum);
    (void)threads;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * moekit_wo_gemm_segments: weight-only (int4 / int8 with group scales) products of rows
 * grouped by expert (segments as above), in fp32:
 *
 *     out[j, r] = sum_k (q[e, r, k] - z[e, r, k / g]) * s[e, r, k / g] * x[j, k],  e = experts[s]
 *             = sum_groups s * (sum_k q x - z * sum_k x)
 *
 * wtype 0: int4 packed two per byte [E, N, K/2] (column 2j the low nibble), z = zero or 8;
 * wtype 1: int8 [E, N, K], z = 0; wtype 2: uint8 [E, N, K] with zero points. scale [E, N, K/g]
 * fp32, zero [E, N, K/g] uint8 or NULL. g is a multiple of 32. Same work split and prefetch as
 * the int8 kernel; the group sums of x are computed once per call.
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#define FSTEP 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* FSTEP consecutive bytes as floats: unsigned, signed; low and high nibbles of FSTEP bytes */
static inline vf vf_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vf_s8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__)
#define FSTEP 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline float vf_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}
static inline vf vf_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vf_s8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#endif

/* One row's weight-only product: sum over groups of s * (sum_k q x - z * sum_k x). With
 * vectors, each group's products stay in lanes, scaled there, and the row reduces once. */
static inline float wo_row(int wtype, const uint8_t *q, const float *sc, const uint8_t *z, const float *x,
                           const float *xe, const float *xo, const float *xs, int64_t K, int64_t g) {
    const int64_t G = K / g;
    float corr = 0.0f;
    for (int64_t c = 0; c < G; c++) corr += sc[c] * (z ? (float)z[c] : (wtype == 0 ? 8.0f : 0.0f)) * xs[c];
#ifdef FSTEP
    vf acc = vf_zero();
    for (int64_t c = 0; c < G; c++) {
        vf a = vf_zero(), b = vf_zero();
        if (wtype == 0) {
            const uint8_t *qc = q + c * g / 2;
            const float *xec = xe + c * g / 2, *xoc = xo + c * g / 2;
            for (int64_t j = 0; j < g / 2; j += FSTEP) {  /* FSTEP bytes: FSTEP even and FSTEP odd columns */
                vf lo, hi;
                vf_nibbles(qc + j, &lo, &hi);
                a = vf_fma(lo, vf_load(xec + j), a);
                b = vf_fma(hi, vf_load(xoc + j), b);
            }
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k += 2 * FSTEP) {
                a = vf_fma(wtype == 1 ? vf_s8(q + k) : vf_u8(q + k), vf_load(x + k), a);
                b = vf_fma(wtype == 1 ? vf_s8(q + k + FSTEP) : vf_u8(q + k + FSTEP), vf_load(x + k + FSTEP), b);
            }
        }
        acc = vf_fma(vf_add(a, b), vf_set1(sc[c]), acc);
    }
    return vf_sum(acc) - corr;
#else
    float acc = 0.0f;
    for (int64_t c = 0; c < G; c++) {
        float d = 0.0f;
        if (wtype == 0) {
            for (int64_t j = c * g / 2; j < (c + 1) * g / 2; j++) d += (float)(q[j] & 15) * xe[j] + (float)(q[j] >> 4) * xo[j];
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k++) d += (wtype == 1 ? (float)(int8_t)q[k] : (float)q[k]) * x[k];
        }
        acc += sc[c] * d;
    }
    return acc - corr;
#endif
}

#ifdef FSTEP
/* wo_row for four consecutive rows at once (row stride row_bytes, G scales a row): four
 * independent accumulator chains hide the FMA latency, and x's lanes load once for four rows. */
static inline void wo_rows4(int wtype, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
                            const float *x, const float *xe, const float *xo, const float *xs, int64_t K, int64_t g,
                            float *out) {
    const int64_t G = K / g;
    vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    float corr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < 4; r++)
        for (int64_t c = 0; c < G; c++)
            corr[r] += sc[r * G + c] * (z ? (float)z[r * G + c] : (wtype == 0 ? 8.0f : 0.0f)) * xs[c];
    for (int64_t c = 0; c < G; c++) {
        vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        if (wtype == 0) {
            for (int64_t j = c * g / 2; j < (c + 1) * g / 2; j += FSTEP) {
                const vf xev = vf_load(xe + j), xov = vf_load(xo + j);
                for (int r = 0; r < 4; r++) {
                    vf lo, hi;
                    vf_nibbles(q + r * row_bytes + j, &lo, &hi);
                    a[r] = vf_fma(hi, xov, vf_fma(lo, xev, a[r]));
                }
            }
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k += FSTEP) {
                const vf xv = vf_load(x + k);
                for (int r = 0; r < 4; r++)
                    a[r] = vf_fma(wtype == 1 ? vf_s8(q + r * row_bytes + k) : vf_u8(q + r * row_bytes + k), xv, a[r]);
            }
        }
        for (int r = 0; r < 4; r++) acc[r] = vf_fma(a[r], vf_set1(sc[r * G + c]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = vf_sum(acc[r]) - corr[r];
}
#endif

#if (defined(__AVX512BW__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && (defined(__AVXVNNI__) || !defined(__AVX512F__)))
/* ---- weight-only products as integer products against x in 16-bit fixed point ----
 * Widening every weight to an fp32 lane costs about as many instructions as streaming it
 * (int4: 55 us per million weights per core, a third of a decode token's time on two cores).
 * vpdpbusd instead multiplies 4 VL unsigned weight bytes by as many signed bytes into VL int32
 * lanes, four products a lane, in one instruction (VL = 16 with AVX-512 VNNI, 8 with AVX-VNNI on
 * AVX2 CPUs). So each group of g columns of x goes to fixed point once per call:
 * X = round(x / 2^e), the step 2^e the smallest power of two with max |x| < 2^(e + XBITS), and
 * X = lo + 256 hi in two signed bytes. A chunk of 4 VL weight bytes (8 VL int4 columns: low and
 * high nibbles; 4 VL uint8 columns; int8 ones as uint8 q + 128 with zero point 128) takes two
 * (uint8) or four (int4) vpdpbusd; the lanes' integer sums are exact, and
 * (256 sum q hi + sum q lo) 2^e times the lane's weight scale accumulates in fp32. The zero
 * points subtract s z sum_k X 2^e per group, so (q - z) multiplies the same rounded x.
 *
 * The only rounding beyond fp32 accumulation is x's to the step: |x - X 2^e| <= 2^-XBITS max|x|
 * of its group. That is finer than x's own rounding to bf16 (2^-9 |x|) except for the values
 * more than 2^5 below their group's largest, and over a group it stays under
 * sqrt(g) 2^-XBITS max|x| <= sqrt(g) 2^-XBITS ||x_group|| in norm (7e-4 ||x_group|| at g = 128,
 * against 2e-3 for bf16 rounding). A third byte (x to fp32 accuracy) cost 10 % more time at
 * decode (bench/NOTES-cpu.md). Rows whose x is not finite, or whose group maxima fall below
 * 2^-100 (where 2^e would leave fp32's normal range), take the fp32 path.
 *
 * With AVX-512 VNNI and groups covering whole chunks (g a multiple of C: 128 for int4 at the
 * default group size), vnni_whole_impl takes an item's rows in one call at decode: each
 * chunk's scale is one value a row (taken times x's step before the pass), the implied zero
 * point (8, or 128 for int8 taken as uint8) starts each lane's integer sum as -z sum X, so
 * (q - z) X sums exactly in int32 and the fp32 zero term goes away, and four rows' sums are
 * added by one transpose. GCC folded x's loads into every vpdpbusd (dpbusd512r keeps them in
 * registers). Zen 5, one core from L2: 5.3 against 7.7 cycles a 64-byte chunk and row at K =
 * 1024, 7.5 against 10.5 at K = 512; sorted calls of 4-8 rows an expert take 0.77-0.85x the
 * time. At decode the weight stream hid that until the rows went one at a time on AMD (the
 * row order above): 0.84x int4, 0.94x int8 (bench/NOTES-cpu.md).
 *
 * AVX2 CPUs without VNNI (AMD Zen 2 / 3, say) take the same route for int4 weights, each
 * vpdpbusd pair done by two vpmaddubsw (nibble times x byte, adjacent pairs summed into int16:
 * at most 2 * 15 * 128 = 3840, the two summed at most 7680, so nothing saturates) and one
 * vpmaddwd by ones into the same int32 lanes: exact as well, 3 instructions a pair of 32 bytes
 * against 16 or more to widen 64 nibbles to fp32 lanes. 8-bit weights keep the fp32 path there:
 * (q + 128) x byte pairs reach 65280 and vpmaddubsw would saturate. */
#define WO_VNNI 1
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define WO_DPBUSD 1         /* vpdpbusd itself (else emulated, int4 only) */
#endif
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VL 16               /* int32 lanes of a vector */
#else
#define VL 8
#endif
#define XBITS 14            /* |X| <= 2^14: lo in [-128, 127], |hi| <= 64 */
#ifndef L2_AHEAD           /* (both distances can be set with -D for experiments) */
#define L2_AHEAD 16384      /* weight bytes ahead a row group prefetches into L2 ... */
#endif
#ifndef L1_AHEAD
#define L1_AHEAD 2048       /* ... and into L1 (measured: one distance alone streamed 20-30 % slower) */
#endif

/* A call's x rows prepared for the VNNI products. Each row (64-byte aligned, so no vector load
 * of lo or hi straddles a cache line): lo [K], hi [K] int8 in the weight bytes' column order
 * (int4: even columns, then odd columns); lane_f [T][VL] (T = K / C chunks of C columns: 8 VL
 * for int4, 4 VL else): 2^e of each lane's group; zs [T][VL] (AVX-512): -z sum X over each
 * lane's columns, z the implied zero point (8 for int4, 128 for int8 taken as uint8); xsum [G]:
 * the groups' sums of X 2^e. */
typedef struct {
    int64_t C, T, per_row;
    int64_t l2, l1;         /* prefetch distances: L2_AHEAD and L1_AHEAD in whole weight rows */
    int32_t *chunk_group;   /* [T]: the group of chunk t's first column */
    int32_t lane_idx[16];   /* groups narrower than a chunk: lane l's group within its chunk */
    char *rows, *ok;        /* [x_rows * per_row] prepared rows; [x_rows] whether each could be */
} vnni_x;

/* Row j of vx, as its parts. */
typedef struct {
    float *lane_f, *xsum;
    int32_t *zs;
    int8_t *lo, *hi;
} vnni_row;
static inline vnni_row vx_row(const vnni_x *vx, int64_t j, int64_t K) {
    vnni_row row;
    row.lo = (int8_t *)(vx->rows + j * vx->per_row);
    row.hi = row.lo + K;
    row.lane_f = (float *)(row.hi + K);
    row.zs = (int32_t *)(row.lane_f + vx->T * VL);
    row.xsum = (float *)(row.zs + vx->T * VL);
    return row;
}

/* The step 2^e of a group whose largest |x| is m (> 0: the smallest power of two with
 * m < 2^(e + XBITS); 0: 1), and its inverse. */
static inline float vnni_step(float m, float *inv) {
    int E = 0;
    if (m > 0.0f) frexpf(m, &E);  /* m < 2^E */
    const int e = m > 0.0f ? E - XBITS : 0;
    *inv = ldexpf(1.0f, -e);
    return ldexpf(1.0f, e);
}

/* Each lane's step: lane l of chunk t covers columns t C + l C / VL onwards, in one group. */
static inline void vnni_lane_steps(const vnni_x *vx, float *lane_f, const float *steps, int64_t g) {
    for (int64_t t = 0; t < vx->T; t++)
        for (int l = 0; l < VL; l++) lane_f[t * VL + l] = steps[(t * vx->C + l * (vx->C / VL)) / g];
}

/* Bytes ahead to prefetch, in whole rows. */
static inline int64_t rows_ahead(int64_t bytes, int64_t row_bytes) { return (bytes + row_bytes - 1) / row_bytes * row_bytes; }

/* sum over a row's groups of s z sum X 2^e: what the zero points take off (z: the stored ones,
 * else 8 for int4 and 128 for int8 weights taken as uint8). */
static inline float vnni_zero_term(int wtype, const float *sc, const uint8_t *z, const float *xsum, int64_t G) {
    float corr = 0.0f;
    for (int64_t c = 0; c < G; c++) corr += sc[c] * (z ? (float)z[c] : (wtype == 0 ? 8.0f : 128.0f)) * xsum[c];
    return corr;
}

#if VL == 16
/* Prepares x row xj into row j of vx; returns 0 where it must take the fp32 path instead. */
static int vnni_prepare(const vnni_x *vx, int64_t j, int wtype, const float *xj, int64_t K, int64_t g) {
    const int64_t G = K / g;
    const vnni_row row = vx_row(vx, j, K);
    float *xsum = row.xsum;
    int8_t *lo = row.lo, *hi = row.hi;
    const __m512 big = _mm512_set1_ps(3.4028235e38f);
    const __m512i b128 = _mm512_set1_epi32(128), b255 = _mm512_set1_epi32(255);
    /* int4: the even and the odd columns of 32 */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    float gf[G];
    for (int64_t c = 0; c < G; c++) {
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = c * g; k < (c + 1) * g; k += 16) {
            const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xj + k));
            if (_mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ)) return 0;  /* inf or nan */
            amax = _mm512_max_ps(amax, a);
        }
        const float m = _mm512_reduce_max_ps(amax);
        if (m > 0.0f && m < 0x1p-100f) return 0;
        float inv_s;
        gf[c] = vnni_step(m, &inv_s);
        const __m512 inv = _mm512_set1_ps(inv_s);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = c * g; k < (c + 1) * g; k += 32) {
            __m512i X0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xj + k), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i X1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xj + k + 16), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(X0, X1));
            int64_t p0 = k, p1 = k + 16;
            if (wtype == 0) {  /* to the nibbles' order */
                const __m512i e16 = _mm512_permutex2var_epi32(X0, even, X1), o16 = _mm512_permutex2var_epi32(X0, odd, X1);
                X0 = e16, X1 = o16, p0 = k / 2, p1 = K / 2 + k / 2;
            }
            const __m512i l0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X0, b128), b255), b128);
            const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, b128), b255), b128);
            _mm_storeu_si128((__m128i *)(lo + p0), _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(lo + p1), _mm512_cvtepi32_epi8(l1));
            _mm_storeu_si128((__m128i *)(hi + p0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X0, l0), 8)));
            _mm_storeu_si128((__m128i *)(hi + p1), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X1, l1), 8)));
        }
        xsum[c] = (float)((double)_mm512_reduce_add_epi32(sum) * gf[c]);
    }
    vnni_lane_steps(vx, row.lane_f, gf, g);
    /* zs: the implied zero point's products, lane by lane as the weight bytes' products sum */
    const __m512i ones = _mm512_set1_epi8(1), zneg = _mm512_set1_epi32(wtype == 0 ? -8 : -128);
    for (int64_t t = 0; t < vx->T; t++) {
        __m512i sl = dpbusd512(_mm512_setzero_si512(), ones, _mm512_loadu_si512((const void *)(lo + t * 64)));
        __m512i sh = dpbusd512(_mm512_setzero_si512(), ones, _mm512_loadu_si512((const void *)(hi + t * 64)));
        if (wtype == 0) {
            sl = dpbusd512(sl, ones, _mm512_loadu_si512((const void *)(lo + K / 2 + t * 64)));
            sh = dpbusd512(sh, ones, _mm512_loadu_si512((const void *)(hi + K / 2 + t * 64)));
        }
        _mm512_storeu_si512((void *)(row.zs + t * 16),
                            _mm512_mullo_epi32(_mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl), zneg));
    }
    return 1;
}

/* n (1 or 4) consecutive weight rows q (stride row_bytes; their scales sc and zero points z,
 * G a row) against prepared x row j, prefetching the rows L2_AHEAD and L1_AHEAD bytes ahead
 * when prefetch is set. */
static inline __attribute__((always_inline)) void vnni_rows_impl(
        const int n, const int wtype, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
        const vnni_x *vx, int64_t j, int64_t K, int64_t g, int prefetch, float *out) {
    const int64_t G = K / g, C = vx->C, half = K / 2;
    const vnni_row row = vx_row(vx, j, K);
    const float *lane_f = row.lane_f;
    const int8_t *lo = row.lo, *hi = row.hi;
    const int64_t l2 = vx->l2, l1 = vx->l1;
    const __m512i nib = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    const __mmask16 gmask = (__mmask16)((1u << (g < C ? C / g : 1)) - 1);
    const __m512i lane_group = _mm512_loadu_si512((const void *)vx->lane_idx);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t t = 0; t < vx->T; t++) {
        if (prefetch)
            for (int r = 0; r < n; r++) {
                _mm_prefetch((const char *)q + l2 + r * row_bytes + t * 64, _MM_HINT_T2);
                _mm_prefetch((const char *)q + l1 + r * row_bytes + t * 64, _MM_HINT_T0);
            }
        const __m512i xl = _mm512_loadu_si512((const void *)(lo + t * 64)), xh = _mm512_loadu_si512((const void *)(hi + t * 64));
        const __m512i xlo = wtype == 0 ? _mm512_loadu_si512((const void *)(lo + half + t * 64)) : xl;
        const __m512i xho = wtype == 0 ? _mm512_loadu_si512((const void *)(hi + half + t * 64)) : xh;
        const __m512 lf = _mm512_loadu_ps(lane_f + t * 16);
        for (int r = 0; r < n; r++) {
            const __m512i wb = _mm512_loadu_si512((const void *)(q + r * row_bytes + t * 64));
            __m512i al, ah;
            if (wtype == 0) {  /* even columns in the low nibbles, odd ones in the high */
                const __m512i we = _mm512_and_si512(wb, nib), wo = _mm512_and_si512(_mm512_srli_epi16(wb, 4), nib);
                al = dpbusd512(dpbusd512(_mm512_setzero_si512(), we, xl), wo, xlo);
                ah = dpbusd512(dpbusd512(_mm512_setzero_si512(), we, xh), wo, xho);
            } else {
                const __m512i wu = wtype == 1 ? _mm512_xor_si512(wb, flip) : wb;  /* int8: q + 128 */
                al = dpbusd512(_mm512_setzero_si512(), wu, xl);
                ah = dpbusd512(_mm512_setzero_si512(), wu, xh);
            }
            const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al));
            const float *scr = sc + r * G;
            const int32_t c0 = vx->chunk_group[t];
            const __m512 sv = g >= C ? _mm512_set1_ps(scr[c0])
                                     : _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(gmask, scr + c0));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(f, lf), sv, acc[r]);
        }
    }
    for (int r = 0; r < n; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) - vnni_zero_term(wtype, sc + r * G, z ? z + r * G : NULL, row.xsum, G);
}

/* vnni_rows_impl for rows whose groups cover whole chunks (g a multiple of C), nr of them (a
 * multiple of 4), four a pass: a chunk's scale is one value a row, taken times x's group step
 * before the pass; without stored zero points (has_z 0) each lane's integer sum starts from the
 * implied zero point's products (zs), so (q - z) X sums exactly in int32; each pass's four sums
 * are added by one transpose. */
static inline __attribute__((always_inline)) void vnni_whole_impl(
        const int wtype, const int has_z, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
        const vnni_x *vx, int64_t j, int64_t K, int64_t g, int64_t nr, const int rowwise, int prefetch, float *out) {
    const int64_t G = K / g, half = K / 2, T = vx->T;
    const vnni_row row = vx_row(vx, j, K);
    const int8_t *lo = row.lo, *hi = row.hi;
    const int64_t l2 = vx->l2, l1 = vx->l1;
    const int32_t *chunk_group = vx->chunk_group;
    const __m512i nib = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    float step[G], s4[4 * G];  /* x's group steps: lane 0 of each group's first chunk */
    for (int64_t c = 0; c < G; c++) step[c] = row.lane_f[c * (g / vx->C) * VL];
    for (int64_t r0 = 0; r0 < nr; r0 += 4) {
        const uint8_t *q0 = q + r0 * row_bytes, *q1 = q0 + row_bytes, *q2 = q1 + row_bytes, *q3 = q2 + row_bytes;
        const float *sr = sc + r0 * G;
        for (int64_t i = 0; i < 4 * G; i += G)
            for (int64_t c = 0; c < G; c++) s4[i + c] = sr[i + c] * step[c];
#define WHOLE_ROW(W, S, A)                                                                                          \
            {                                                                                                       \
                __m512i wb = _mm512_loadu_si512((const void *)((W) + t * 64));                                      \
                __asm__("" : "+v"(wb)); /* one load for both nibbles */                                             \
                __m512i al, ah;                                                                                     \
                if (wtype == 0) {                                                                                   \
                    const __m512i we = _mm512_and_si512(wb, nib);                                                   \
                    const __m512i wo = _mm512_and_si512(_mm512_srli_epi16(wb, 4), nib);                             \
                    al = dpbusd512r(dpbusd512r(init, we, xl), wo, xlo);                                             \
                    ah = dpbusd512r(dpbusd512r(_mm512_setzero_si512(), we, xh), wo, xho);                           \
                } else {                                                                                            \
                    const __m512i wu = wtype == 1 ? _mm512_xor_si512(wb, flip) : wb;                                \
                    al = dpbusd512r(init, wu, xl);                                                                  \
                    ah = dpbusd512r(_mm512_setzero_si512(), wu, xh);                                                \
                }                                                                                                   \
                const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al));                \
                A = _mm512_fmadd_ps(f, _mm512_set1_ps((S)[c]), A);                                                  \
            }
        __m512 a0, a1, a2, a3;
        if (rowwise) {  /* one row after another (MOEKIT_ROW_GROUP 1), ROW_AHEAD prefetched as the other
                         * kernels' rows (through prefetch_row_ahead GCC 12 left the prefetches out here) */
            __m512 a[4];
            for (int r = 0; r < 4; r++) {
                const uint8_t *qr = q0 + r * row_bytes;
                if (prefetch)
                    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)qr + ROW_AHEAD + b, _MM_HINT_T0);
                __m512 A = _mm512_setzero_ps();
                for (int64_t t = 0; t < T; t++) {
                    const __m512i xl = _mm512_loadu_si512((const void *)(lo + t * 64));
                    const __m512i xh = _mm512_loadu_si512((const void *)(hi + t * 64));
                    const __m512i xlo = wtype == 0 ? _mm512_loadu_si512((const void *)(lo + half + t * 64)) : xl;
                    const __m512i xho = wtype == 0 ? _mm512_loadu_si512((const void *)(hi + half + t * 64)) : xh;
                    const __m512i init = has_z ? _mm512_setzero_si512()
                                               : _mm512_load_si512((const void *)(row.zs + t * 16));
                    const int64_t c = chunk_group[t];
                    WHOLE_ROW(qr, s4 + r * G, A)
                }
                a[r] = A;
            }
            a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
        } else {
            a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t t = 0; t < T; t++) {
                if (prefetch) {
                    _mm_prefetch((const char *)q0 + l2 + t * 64, _MM_HINT_T2);
                    _mm_prefetch((const char *)q1 + l2 + t * 64, _MM_HINT_T2);
                    _mm_prefetch((const char *)q2 + l2 + t * 64, _MM_HINT_T2);
                    _mm_prefetch((const char *)q3 + l2 + t * 64, _MM_HINT_T2);
                    _mm_prefetch((const char *)q0 + l1 + t * 64, _MM_HINT_T0);
                    _mm_prefetch((const char *)q1 + l1 + t * 64, _MM_HINT_T0);
                    _mm_prefetch((const char *)q2 + l1 + t * 64, _MM_HINT_T0);
                    _mm_prefetch((const char *)q3 + l1 + t * 64, _MM_HINT_T0);
                }
                const __m512i xl = _mm512_loadu_si512((const void *)(lo + t * 64));
                const __m512i xh = _mm512_loadu_si512((const void *)(hi + t * 64));
                const __m512i xlo = wtype == 0 ? _mm512_loadu_si512((const void *)(lo + half + t * 64)) : xl;
                const __m512i xho = wtype == 0 ? _mm512_loadu_si512((const void *)(hi + half + t * 64)) : xh;
                const __m512i init = has_z ? _mm512_setzero_si512() : _mm512_load_si512((const void *)(row.zs + t * 16));
                const int64_t c = chunk_group[t];
                WHOLE_ROW(q0, s4, a0)
                WHOLE_ROW(q1, s4 + G, a1)
                WHOLE_ROW(q2, s4 + 2 * G, a2)
                WHOLE_ROW(q3, s4 + 3 * G, a3)
            }
        }
#undef WHOLE_ROW
        __m128 s = sum4x16(a0, a1, a2, a3);
        if (has_z) {
            float zt[4];
            for (int r = 0; r < 4; r++) zt[r] = vnni_zero_term(wtype, sr + r * G, z + (r0 + r) * G, row.xsum, G);
            s = _mm_sub_ps(s, _mm_loadu_ps(zt));
        }
        _mm_storeu_ps(out + r0, s);
    }
}

#else
/* The low bytes of eight int32 lanes (each in int8's range) to p. */
static inline void store_bytes8(int8_t *p, __m256i v) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(v, pick);
    _mm_storel_epi64((__m128i *)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* Prepares x row xj into row j of vx (as the AVX-512 version, eight values a vector); returns 0
 * where it must take the fp32 path instead. */
static int vnni_prepare(const vnni_x *vx, int64_t j, int wtype, const float *xj, int64_t K, int64_t g) {
    const int64_t G = K / g;
    const vnni_row row = vx_row(vx, j, K);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(3.4028235e38f);
    const __m256i b128 = _mm256_set1_epi32(128), b255 = _mm256_set1_epi32(255);
    const __m256i deal = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  /* even lanes low, odd lanes high */
    float gf[G];
    for (int64_t c = 0; c < G; c++) {
        __m256 amax = _mm256_setzero_ps();
        for (int64_t k = c * g; k < (c + 1) * g; k += 8) {
            const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xj + k), absmask);
            if (_mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ))) return 0;  /* inf or nan */
            amax = _mm256_max_ps(amax, a);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55)));
        if (m > 0.0f && m < 0x1p-100f) return 0;
        float inv_s;
        gf[c] = vnni_step(m, &inv_s);
        const __m256 inv = _mm256_set1_ps(inv_s);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t k = c * g; k < (c + 1) * g; k += 16) {
            /* round half to even: the default rounding mode, as nearbyintf */
            __m256i X0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + k), inv));
            __m256i X1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xj + k + 8), inv));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(X0, X1));
            int64_t p0 = k, p1 = k + 8;
            if (wtype == 0) {  /* to the nibbles' order: the 8 even columns, then the 8 odd ones */
                const __m256i a = _mm256_permutevar8x32_epi32(X0, deal), b = _mm256_permutevar8x32_epi32(X1, deal);
                X0 = _mm256_permute2x128_si256(a, b, 0x20), X1 = _mm256_permute2x128_si256(a, b, 0x31);
                p0 = k / 2, p1 = K / 2 + k / 2;
            }
            const __m256i l0 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X0, b128), b255), b128);
            const __m256i l1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X1, b128), b255), b128);
            store_bytes8(row.lo + p0, l0);
            store_bytes8(row.lo + p1, l1);
            store_bytes8(row.hi + p0, _mm256_srai_epi32(_mm256_sub_epi32(X0, l0), 8));
            store_bytes8(row.hi + p1, _mm256_srai_epi32(_mm256_sub_epi32(X1, l1), 8));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        row.xsum[c] = (float)((double)_mm_cvtsi128_si32(s4) * gf[c]);
    }
    vnni_lane_steps(vx, row.lane_f, gf, g);
    return 1;
}

/* The int32 lanes of nibble bytes we, wo against x bytes xe, xo (four products a lane, as two
 * vpdpbusd), with VNNI or without. */
static inline __m256i int4_lanes(__m256i we, __m256i xe, __m256i wo, __m256i xo) {
#ifdef WO_DPBUSD
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), we, xe), wo, xo);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(we, xe), _mm256_maddubs_epi16(wo, xo));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* 256-bit sum of fp32 lanes (vf_sum's type is 512-bit on AVX-512 builds). */
static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

#ifndef WO_DPBUSD
/* Without VNNI, int4 rows whose chunks each lie in one group (g a multiple of C, at most 4096
 * columns so a group's int32 sums cannot overflow): each chunk's four products a lane go into
 * one int32 sum per row, lo + 256 hi (vpmaddwd by 1 and by 256), converted and scaled once a
 * group: 13 instructions a row and chunk, against 23 for the per-chunk scaling.
 * int4_chunk: chunk t of n rows into their int32 sums s. */
static inline __attribute__((always_inline)) void int4_chunk(
        const int n, const uint8_t *q, int64_t row_bytes, const vnni_row *row, int64_t half, int64_t t, __m256i *s) {
    const __m256i nib = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
    const __m256i xl = _mm256_loadu_si256((const __m256i *)(row->lo + t * 32));
    const __m256i xh = _mm256_loadu_si256((const __m256i *)(row->hi + t * 32));
    const __m256i xlo = _mm256_loadu_si256((const __m256i *)(row->lo + half + t * 32));
    const __m256i xho = _mm256_loadu_si256((const __m256i *)(row->hi + half + t * 32));
    for (int r = 0; r < n; r++) {
        const __m256i wb = _mm256_loadu_si256((const __m256i *)(q + r * row_bytes + t * 32));
        const __m256i we = _mm256_and_si256(wb, nib), wo = _mm256_and_si256(_mm256_srli_epi16(wb, 4), nib);
        const __m256i l16 = _mm256_add_epi16(_mm256_maddubs_epi16(we, xl), _mm256_maddubs_epi16(wo, xlo));
        const __m256i h16 = _mm256_add_epi16(_mm256_maddubs_epi16(we, xh), _mm256_maddubs_epi16(wo, xho));
        s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_madd_epi16(l16, one), _mm256_madd_epi16(h16, c256)));
    }
}

/* n (1 or 4) rows from q against prepared x row `row`, two chunks (a 64-byte line of each row)
 * an iteration. */
static inline __attribute__((always_inline)) void int4_group_rows(
        const int n, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z, const vnni_x *vx,
        const vnni_row *row, int64_t K, int64_t g, int prefetch, float *out) {
    const int64_t G = K / g, per = g / vx->C, half = K / 2, l2 = vx->l2, l1 = vx->l1;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < G; c++) {
        __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        int64_t t = c * per;
        for (; t + 2 <= (c + 1) * per; t += 2) {  /* a 64-byte line of each row: two chunks */
            if (prefetch)
                for (int r = 0; r < n; r++) {
                    _mm_prefetch((const char *)q + l2 + r * row_bytes + t * 32, _MM_HINT_T2);
                    _mm_prefetch((const char *)q + l1 + r * row_bytes + t * 32, _MM_HINT_T0);
                }
            int4_chunk(n, q, row_bytes, row, half, t, s);
            int4_chunk(n, q, row_bytes, row, half, t + 1, s);
        }
        if (t < (c + 1) * per) {  /* odd chunks a group (g = 64 C' for odd C'): one chunk, its line's first or last */
            if (prefetch && (t & 1) == 0)
                for (int r = 0; r < n; r++) {
                    _mm_prefetch((const char *)q + l2 + r * row_bytes + t * 32, _MM_HINT_T2);
                    _mm_prefetch((const char *)q + l1 + r * row_bytes + t * 32, _MM_HINT_T0);
                }
            int4_chunk(n, q, row_bytes, row, half, t, s);
        }
        const float step = row->lane_f[c * per * VL];  /* every lane of the group's chunks */
        for (int r = 0; r < n; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_set1_ps(step * sc[r * G + c]), acc[r]);
    }
    for (int r = 0; r < n; r++)
        out[r] = sum8(acc[r]) - vnni_zero_term(0, sc + r * G, z ? z + r * G : NULL, row->xsum, G);
}

/* int4_group_rows over `rows` consecutive weight rows (an item's), MOEKIT_ROW_GROUP at a time
 * or, with `four`, four (segments of several x rows, whose products the item's weights in L1
 * bound by arithmetic: four rows share x's loads): one call an item and x row, so the setup is
 * paid once and not every few rows. */
static void int4_item_rows(const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z, const vnni_x *vx,
                           int64_t j, int64_t K, int64_t g, int64_t rows, int prefetch, int four, float *out) {
    const int64_t G = K / g;
    const vnni_row row = vx_row(vx, j, K);
    int64_t r = 0;
    if (MOEKIT_ROW_GROUP == 4 || four)
        for (; r + 4 <= rows; r += 4)
            int4_group_rows(4, q + r * row_bytes, row_bytes, sc + r * G, z ? z + r * G : NULL, vx, &row, K, g,
                            prefetch, out + r);
    for (; r < rows; r++)
        int4_group_rows(1, q + r * row_bytes, row_bytes, sc + r * G, z ? z + r * G : NULL, vx, &row, K, g, prefetch,
                        out + r);
}
#endif

/* vnni_rows_impl on 256-bit vectors (chunks of 32 weight bytes): AVX-VNNI, or AVX2 for int4. */
static inline __attribute__((always_inline)) void vnni_rows_impl(
        const int n, const int wtype, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
        const vnni_x *vx, int64_t j, int64_t K, int64_t g, int prefetch, float *out) {
    const int64_t G = K / g, C = vx->C, half = K / 2;
    const vnni_row row = vx_row(vx, j, K);
    const float *lane_f = row.lane_f;
    const int8_t *lo = row.lo, *hi = row.hi;
    const int64_t l2 = vx->l2, l1 = vx->l1;
    const __m256i nib = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    const __m256i lane_group = _mm256_loadu_si256((const __m256i *)vx->lane_idx);
    int32_t mask[8];
    for (int l = 0; l < 8; l++) mask[l] = g < C && l < C / g ? -1 : 0;
    const __m256i gmask = _mm256_loadu_si256((const __m256i *)mask);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t t = 0; t < vx->T; t++) {
        if (prefetch && (t & 1) == 0)  /* a 64-byte line holds two chunks */
            for (int r = 0; r < n; r++) {
                _mm_prefetch((const char *)q + l2 + r * row_bytes + t * 32, _MM_HINT_T2);
                _mm_prefetch((const char *)q + l1 + r * row_bytes + t * 32, _MM_HINT_T0);
            }
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(lo + t * 32));
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(hi + t * 32));
        const __m256i xlo = wtype == 0 ? _mm256_loadu_si256((const __m256i *)(lo + half + t * 32)) : xl;
        const __m256i xho = wtype == 0 ? _mm256_loadu_si256((const __m256i *)(hi + half + t * 32)) : xh;
        const __m256 lf = _mm256_loadu_ps(lane_f + t * 8);
        for (int r = 0; r < n; r++) {
            const __m256i wb = _mm256_loadu_si256((const __m256i *)(q + r * row_bytes + t * 32));
            __m256i al, ah;
            if (wtype == 0) {  /* even columns in the low nibbles, odd ones in the high */
                const __m256i we = _mm256_and_si256(wb, nib), wo = _mm256_and_si256(_mm256_srli_epi16(wb, 4), nib);
                al = int4_lanes(we, xl, wo, xlo);
                ah = int4_lanes(we, xh, wo, xho);
            } else {
#ifdef WO_DPBUSD
                const __m256i wu = wtype == 1 ? _mm256_xor_si256(wb, flip) : wb;  /* int8: q + 128 */
                al = _mm256_dpbusd_avx_epi32(zero, wu, xl);
                ah = _mm256_dpbusd_avx_epi32(zero, wu, xh);
#else
                al = ah = zero;  /* not reached: vnni_init keeps 8-bit weights off this path here */
                (void)wb, (void)flip;
#endif
            }
            const __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ah, 8), al));
            const float *scr = sc + r * G;
            const int32_t c0 = vx->chunk_group[t];
            const __m256 sv = g >= C ? _mm256_set1_ps(scr[c0])
                                     : _mm256_permutevar8x32_ps(_mm256_maskload_ps(scr + c0, gmask), lane_group);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(f, lf), sv, acc[r]);
        }
    }
    for (int r = 0; r < n; r++)
        out[r] = sum8(acc[r]) - vnni_zero_term(wtype, sc + r * G, z ? z + r * G : NULL, row.xsum, G);
}
#endif

#define VNNI_ROWS(NAME, N, WT)                                                                          \
    static void NAME(const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z, const vnni_x *vx, \
                     int64_t j, int64_t K, int64_t g, int prefetch, float *out) {                         \
        vnni_rows_impl(N, WT, q, row_bytes, sc, z, vx, j, K, g, prefetch, out);                           \
    }
VNNI_ROWS(vnni_rows4_int4, 4, 0)
VNNI_ROWS(vnni_row_int4, 1, 0)
VNNI_ROWS(vnni_rows4_int8, 4, 1)
VNNI_ROWS(vnni_row_int8, 1, 1)
VNNI_ROWS(vnni_rows4_uint8, 4, 2)
VNNI_ROWS(vnni_row_uint8, 1, 2)
#if VL == 16
#define VNNI_WHOLE(NAME, WT, Z, ROWWISE)                                                                \
    static void NAME(const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z, const vnni_x *vx, \
                     int64_t j, int64_t K, int64_t g, int64_t nr, int prefetch, float *out) {            \
        vnni_whole_impl(WT, Z, q, row_bytes, sc, z, vx, j, K, g, nr, ROWWISE, prefetch, out);             \
    }
#define VNNI_WHOLE_SET(P, ROWWISE)                                                                      \
    VNNI_WHOLE(P##_int4, 0, 0, ROWWISE)                                                                 \
    VNNI_WHOLE(P##_int8, 1, 0, ROWWISE)                                                                 \
    VNNI_WHOLE(P##_uint8, 2, 0, ROWWISE)                                                                \
    VNNI_WHOLE(P##_int4_z, 0, 1, ROWWISE)                                                               \
    VNNI_WHOLE(P##_int8_z, 1, 1, ROWWISE)                                                               \
    VNNI_WHOLE(P##_uint8_z, 2, 1, ROWWISE)
VNNI_WHOLE_SET(vnni_whole, 0)
#if MOEKIT_ROW_GROUP == 1
VNNI_WHOLE_SET(vnni_whole1, 1)
#endif
typedef void (*vnni_whole_fn)(const uint8_t *, int64_t, const float *, const uint8_t *, const vnni_x *, int64_t,
                              int64_t, int64_t, int64_t, int, float *);
#endif
typedef void (*vnni_rows_fn)(const uint8_t *, int64_t, const float *, const uint8_t *, const vnni_x *, int64_t,
                             int64_t, int64_t, int, float *);

/* Sets up vx for x_rows rows of this call (each prepared later by vnni_prepare); 0 where the
 * VNNI products do not fit this call (chunks straddling groups) or the scratch cannot be
 * allocated: the fp32 path runs. */
static int vnni_init(vnni_x *vx, int wtype, int64_t x_rows, int64_t K, int64_t g) {
    const int64_t C = (wtype == 0 ? 8 : 4) * VL, G = K / g;
    vx->rows = NULL;
    if (K % C || (g % C && C % g)) return 0;
#ifndef WO_DPBUSD
    if (wtype != 0) return 0;  /* int4 only without VNNI (see above) */
#endif
    vx->C = C, vx->T = K / C, vx->per_row = (2 * K + 4 * (2 * vx->T * VL + G) + 63) / 64 * 64;
    vx->l2 = rows_ahead(L2_AHEAD, wtype == 0 ? K / 2 : K), vx->l1 = rows_ahead(L1_AHEAD, wtype == 0 ? K / 2 : K);
    const size_t bytes = (size_t)(x_rows * (vx->per_row + 1) + 4 * vx->T);
    vx->rows = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);  /* free() releases it */
    if (vx->rows == NULL) return 0;
    vx->chunk_group = (int32_t *)(vx->rows + x_rows * vx->per_row);
    vx->ok = (char *)(vx->chunk_group + vx->T);
    for (int64_t t = 0; t < vx->T; t++) vx->chunk_group[t] = (int32_t)(t * C / g);
    for (int l = 0; l < 16; l++) vx->lane_idx[l] = g < C && l < VL ? (int32_t)(l * (C / VL) / g) : 0;
    return 1;
}
#endif

/* One weight-only product call: weights, segments, x rows (x_stride 0: one shared row) and
 * their prepared forms (scratch: per row its even and odd columns and its group sums, for the
 * fp32 path; vx for the VNNI products), output out [rows, N]. */
typedef struct {
    int wtype;
    const uint8_t *w, *zero;
    const float *scale, *x;
    const int64_t *experts, *starts;
    int64_t x_stride, N, K, g, G, row_bytes, per_x, blocks;
    float *scratch, *out;
#ifdef WO_VNNI
    int vnni;
    vnni_x vx;
    vnni_rows_fn rows4, row1;
#if VL == 16
    vnni_whole_fn whole, whole1;  /* where groups cover whole chunks: rows four a pass, and in the
                                   * build's decode row order (or NULL) */
#endif
    int int4_items;  /* int4_item_rows serves the VNNI products (AVX2 without VNNI, g a multiple of C) */
#endif
} wo_call;

/* Allocates c's scratch for x_rows rows; 0 when it cannot. */
static int wo_init(wo_call *c, int64_t x_rows) {
    c->G = c->K / c->g, c->row_bytes = c->wtype == 0 ? c->K / 2 : c->K, c->per_x = 2 * c->K + c->G;
    c->blocks = (c->N + ROWS - 1) / ROWS;
    c->scratch = (float *)malloc((size_t)(x_rows * c->per_x) * sizeof(float));
    if (c->scratch == NULL) return 0;
#ifdef WO_VNNI
    c->vnni = vnni_init(&c->vx, c->wtype, x_rows, c->K, c->g);
    c->rows4 = c->wtype == 0 ? vnni_rows4_int4 : (c->wtype == 1 ? vnni_rows4_int8 : vnni_rows4_uint8);
    c->row1 = c->wtype == 0 ? vnni_row_int4 : (c->wtype == 1 ? vnni_row_int8 : vnni_row_uint8);
#if VL == 16
    static const vnni_whole_fn whole[2][3] = {{vnni_whole_int4, vnni_whole_int8, vnni_whole_uint8},
                                              {vnni_whole_int4_z, vnni_whole_int8_z, vnni_whole_uint8_z}};
    const int fits = c->vnni && c->g % c->vx.C == 0;
    c->whole = fits ? whole[c->zero != NULL][c->wtype] : NULL;
#if MOEKIT_ROW_GROUP == 1
    static const vnni_whole_fn whole1[2][3] = {{vnni_whole1_int4, vnni_whole1_int8, vnni_whole1_uint8},
                                               {vnni_whole1_int4_z, vnni_whole1_int8_z, vnni_whole1_uint8_z}};
    c->whole1 = fits ? whole1[c->zero != NULL][c->wtype] : NULL;
#else
    c->whole1 = c->whole;
#endif
#endif
#ifdef WO_DPBUSD
    c->int4_items = 0;
#else
    c->int4_items = c->vnni && c->wtype == 0 && c->g % c->vx.C == 0 && c->g <= 4096;
#endif
#endif
    return 1;
}

static void wo_free(wo_call *c) {
    free(c->scratch);
#ifdef WO_VNNI
    free(c->vx.rows);
#endif
}

/* Prepares x row j (c->x + j x_stride) for the products: for the VNNI ones where the call
 * and the row allow them, else for the fp32 path. */
static void wo_prepare_row(wo_call *c, int64_t j) {
    const int64_t K = c->K, g = c->g;
    const float *xj = c->x + j * c->x_stride;
#ifdef WO_VNNI
    if (c->vnni && (c->vx.ok[j] = (char)vnni_prepare(&c->vx, j, c->wtype, xj, K, g))) return;
#endif
    float *xe = c->scratch + j * c->per_x, *xo = xe + K / 2, *xs = xe + K;
    for (int64_t k = 0; k < K / 2; k++) { xe[k] = xj[2 * k]; xo[k] = xj[2 * k + 1]; }
    for (int64_t k = 0; k < c->G; k++) {
        float t = 0.0f;
        for (int64_t i = k * g; i < (k + 1) * g; i++) t += xj[i];
        xs[k] = t;
    }
}

#ifdef WO_VNNI
/* n consecutive weight rows q (their scales sc, zero points z) against x row jx on the fp32
 * path (rows the VNNI products cannot take): out[0..n). */
static void wo_rows_fp32(const wo_call *c, const uint8_t *q, const float *sc, const uint8_t *z, int64_t jx, int64_t n,
                         float *out) {
    const int64_t K = c->K, G = c->G;
    const float *xe = c->scratch + jx * c->per_x;
    for (int64_t i = 0; i < n; i++)
        out[i] = wo_row(c->wtype, q + i * c->row_bytes, sc + i * G, z ? z + i * G : NULL, c->x + jx * c->x_stride, xe,
                        xe + K / 2, xe + K, K, c->g);
}
#endif

/* Work item `item` (a segment's block of ROWS weight rows) of a weight-only call. */
static void wo_item(const wo_call *c, int64_t item) {
    const int64_t N = c->N, K = c->K, g = c->g, G = c->G, row_bytes = c->row_bytes, per_x = c->per_x;
    const work_item it = item_of(item, c->blocks, c->starts, N);
    const int64_t e = c->experts[it.s], jstep = c->x_stride ? 1 : 0;
    int64_t r = it.r0;
#ifdef WO_VNNI
#ifndef WO_DPBUSD
    if (c->int4_items) {
        /* one x row (decode): the item's rows in one call; several: four rows at a time, each
         * block in L1 across the segment's x rows */
        const int many = it.j1 - it.j0 > 1;
        const int64_t step = MOEKIT_ROW_GROUP == 4 || many ? 4 : it.r1 - r;
        for (int64_t r0 = r; r0 < it.r1; r0 += step) {
            const int64_t rows = it.r1 - r0 < step ? it.r1 - r0 : step;
            const uint8_t *q = c->w + (e * N + r0) * row_bytes, *z = c->zero ? c->zero + (e * N + r0) * G : NULL;
            const float *sc = c->scale + (e * N + r0) * G;
            for (int64_t j = it.j0; j < it.j1; j++) {
                const int64_t jx = j * jstep;
                float *o = c->out + j * N + r0;
                if (c->vx.ok[jx]) {
                    int4_item_rows(q, row_bytes, sc, z, &c->vx, jx, K, g, rows, j == it.j0, many, o);
                    continue;
                }
                const float *xe = c->scratch + jx * per_x;
                for (int64_t i = 0; i < rows; i++)
                    o[i] = wo_row(c->wtype, q + i * row_bytes, sc + i * G, z ? z + i * G : NULL,
                                  c->x + jx * c->x_stride, xe, xe + K / 2, xe + K, K, g);
            }
        }
        return;
    }
#endif
    /* int4 rows take four a pass whatever the x rows here: four of their short rows (K / 2
     * bytes) read nearly one stream, and their products share x's expansion (Zen 5: one int4 row
     * at a time measured 1.03-1.1x slower at decode, 1.3x at 2-3 x rows an expert, before
     * vnni_whole_impl, which follows the build's row order at decode: one row at a time there
     * took int4 0.84x, int8 0.94x the time of the four-row passes on Zen 5) */
    const int group = c->wtype == 0 || FOUR_A_PASS(it.j1 - it.j0) ? 4 : 1;
#if VL == 16
    if (c->vnni && c->whole && (group == 4 || it.j1 - it.j0 == 1)) {
        /* one x row (decode): the item's rows in one call, in the build's row order; several:
         * four rows a call, each four in L1 across the segment's x rows */
        const int one = it.j1 - it.j0 == 1;
        const int64_t full = (it.r1 - r) / 4 * 4, span = one ? full : 4;
        const vnni_whole_fn rows = one ? c->whole1 : c->whole;
        for (const int64_t r1 = r + full; r < r1; r += span) {
            const uint8_t *q = c->w + (e * N + r) * row_bytes;
            const uint8_t *z = c->zero ? c->zero + (e * N + r) * G : NULL;
            const float *sc = c->scale + (e * N + r) * G;
            for (int64_t j = it.j0; j < it.j1; j++) {
                const int64_t jx = j * jstep;
                float *o = c->out + j * N + r;
                if (c->vx.ok[jx]) {
                    rows(q, row_bytes, sc, z, &c->vx, jx, K, g, span, j == it.j0, o);
                    continue;
                }
                wo_rows_fp32(c, q, sc, z, jx, span, o);
            }
        }
    }
#endif
    if (c->vnni)
        for (; r < it.r1; r += group) {
            const int n = it.r1 - r < group ? (int)(it.r1 - r) : group;
            const uint8_t *q = c->w + (e * N + r) * row_bytes, *z = c->zero ? c->zero + (e * N + r) * G : NULL;
            const float *sc = c->scale + (e * N + r) * G;
            for (int64_t j = it.j0; j < it.j1; j++) {  /* the weight rows stay in L1 across the segment's x rows */
                const int64_t jx = j * jstep;
                float *o = c->out + j * N + r;
                if (c->vx.ok[jx]) {
                    if (n == 4) c->rows4(q, row_bytes, sc, z, &c->vx, jx, K, g, j == it.j0, o);
                    else
                        for (int i = 0; i < n; i++)
                            c->row1(q + i * row_bytes, row_bytes, sc + i * G, z ? z + i * G : NULL, &c->vx, jx, K, g,
                                    j == it.j0, o + i);
                    continue;
                }
                wo_rows_fp32(c, q, sc, z, jx, n, o);
            }
        }
#endif
#if defined(FSTEP) && FOUR_ROWS
    if (FOUR_A_PASS(it.j1 - it.j0))
    for (; r + 4 <= it.r1; r += 4) {
        const uint8_t *q = c->w + (e * N + r) * row_bytes;
        for (int64_t b = 0; b < 4 * row_bytes; b += 64) prefetch_line((const int8_t *)q + PREFETCH_ROWS * row_bytes + b);
        for (int64_t j = it.j0; j < it.j1; j++) {  /* the four weight rows stay in L1 across the segment's x rows */
            const float *xe = c->scratch + j * jstep * per_x;
            wo_rows4(c->wtype, q, row_bytes, c->scale + (e * N + r) * G, c->zero ? c->zero + (e * N + r) * G : NULL,
                     c->x + j * jstep * c->x_stride, xe, xe + K / 2, xe + K, K, g, c->out + j * N + r);
        }
    }
#endif
    for (; r < it.r1; r++) {
        const uint8_t *q = c->w + (e * N + r) * row_bytes, *z = c->zero ? c->zero + (e * N + r) * G : NULL;
        const float *sc = c->scale + (e * N + r) * G;
        prefetch_row_ahead(q, row_bytes);
        for (int64_t j = it.j0; j < it.j1; j++) {
            const float *xe = c->scratch + j * jstep * per_x;
            c->out[j * N + r] = wo_row(c->wtype, q, sc, z, c->x + j * jstep * c->x_stride, xe, xe + K / 2, xe + K, K, g);
        }
    }
}

/* Returns 0, 1 when the scratch cannot be allocated, 2 for a bad wtype or g. */
int moekit_wo_gemm_segments(int wtype, const uint8_t *w, const float *scale, const uint8_t *zero,
                            const int64_t *experts, const int64_t *starts, int64_t segments, const float *x,
                            int64_t x_stride, int64_t N, int64_t K, int64_t g, float *out, int threads) {
    if (wtype < 0 || wtype > 2 || g <= 0 || g % 32 || K % g) return 2;
    const int64_t x_rows = x_stride ? seg_begin(starts, segments) : 1;
    wo_call c = {0};
    c.wtype = wtype, c.w = w, c.zero = zero, c.scale = scale, c.x = x, c.experts = experts, c.starts = starts;
    c.x_stride = x_stride, c.N = N, c.K = K, c.g = g, c.out = out;
    if (!wo_init(&c, x_rows)) return 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        OMP_FOR
        for (int64_t j = 0; j < x_rows; j++) wo_prepare_row(&c, j);
        OMP_FOR
        for (int64_t item = 0; item < segments * c.blocks; item++) wo_item(&c, item);
    }
    wo_free(&c);
    (void)threads;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * moekit_float_gemm_segments: 16-bit or fp32 weights against fp32 rows (segments as above):
 *
 *     out[j, r] = sum_k float(w[experts[s], r, k]) * x[j, k]       (fp32 accumulation)
 *
 * wtype 0: fp32, 1: bf16 (the upper half of an fp32: widened exactly by a shift), 2: fp16.
 * Four weight rows a pass, prefetching the rows PREFETCH_ROWS ahead, as the int8 kernel.
 * ------------------------------------------------------------------------------------------- */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);         /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);  /* normal */
    else if (man) {                                                 /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
    } else bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float wload1(int wtype, const void *w, int64_t k) {
    if (wtype == 0) return ((const float *)w)[k];
    if (wtype == 2) return half_to_float(((const uint16_t *)w)[k]);
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[k] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float fdot_tail(int wtype, const void *w, const float *x, int64_t k0, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = k0; k < K; k++) acc += wload1(wtype, w, k) * x[k];
    return acc;
}

#ifdef FSTEP
/* FSTEP weights from element k of a row, as floats */
static inline vf wload(int wtype, const void *w, int64_t k) {
#if defined(__AVX512F__)
    if (wtype == 0) return _mm512_loadu_ps((const float *)w + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    if (wtype == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    if (wtype == 0) return _mm256_loadu_ps((const float *)w + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
#if defined(__F16C__)
    if (wtype == 2) return _mm256_cvtph_ps(h);
#else
    if (wtype == 2) {
        float f[8];
        for (int i = 0; i < 8; i++) f[i] = half_to_float(((const uint16_t *)w)[k + i]);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}
#endif

static inline void frows4(int wtype, const char *w, int64_t row_bytes, int64_t K, const float *x, float *out) {
#ifdef FSTEP
    const int64_t kv = K - K % FSTEP, esize = row_bytes / K;
    const char *ahead = w + PREFETCH_ROWS * row_bytes;
    vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();
    for (int64_t k = 0; k < kv; k += FSTEP) {
        if (((k * esize) & 63) == 0) {
            for (int j = 0; j < 4; j++) _mm_prefetch(ahead + j * row_bytes + k * esize, _MM_HINT_T0);
            if (esize == 4)
                for (int j = 0; j < 4; j++) _mm_prefetch(ahead + j * row_bytes + k * esize + 64, _MM_HINT_T0);
        }
        vf xv = vf_load(x + k);
        a0 = vf_fma(wload(wtype, w, k), xv, a0);
        a1 = vf_fma(wload(wtype, w + row_bytes, k), xv, a1);
        a2 = vf_fma(wload(wtype, w + 2 * row_bytes, k), xv, a2);
        a3 = vf_fma(wload(wtype, w + 3 * row_bytes, k), xv, a3);
    }
    out[0] = vf_sum(a0) + fdot_tail(wtype, w, x, kv, K);
    out[1] = vf_sum(a1) + fdot_tail(wtype, w + row_bytes, x, kv, K);
    out[2] = vf_sum(a2) + fdot_tail(wtype, w + 2 * row_bytes, x, kv, K);
    out[3] = vf_sum(a3) + fdot_tail(wtype, w + 3 * row_bytes, x, kv, K);
#else
    for (int j = 0; j < 4; j++) out[j] = fdot_tail(wtype, w + j * row_bytes, x, 0, K);
#endif
}

/* One row of w against x (two accumulator chains), fp32 accumulation. */
static inline float frow1(int wtype, const char *w, int64_t K, const float *x) {
#ifdef FSTEP
    const int64_t kv = K - K % FSTEP;
    vf a0 = vf_zero(), a1 = vf_zero();
    int64_t k = 0;
    for (; k + 2 * FSTEP <= kv; k += 2 * FSTEP) {
        a0 = vf_fma(wload(wtype, w, k), vf_load(x + k), a0);
        a1 = vf_fma(wload(wtype, w, k + FSTEP), vf_load(x + k + FSTEP), a1);
    }
    if (k < kv) a0 = vf_fma(wload(wtype, w, k), vf_load(x + k), a0);
    return vf_sum(vf_add(a0, a1)) + fdot_tail(wtype, w, x, kv, K);
#else
    return fdot_tail(wtype, w, x, 0, K);
#endif
}

/* One float product call. xp: where set (PAIR_BLOCKS), the x rows split in the order pair_block
 * widens the weights, [rows][K / 2 | K / 2] (pair_prepare). */
typedef struct {
    int wtype;
    const void *w;
    const int64_t *experts, *starts;
    const float *x;
    int64_t x_stride, N, K, row_bytes, blocks;
    float *out;
    const float *xp;
} float_call;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* 16-bit weights against several x rows on AVX2 (no native bf16 or fp16 products there). 16
 * loaded weights widen in two operations, into two vectors of 8 (we, wo), against x rows split
 * once a call to match (pair_prepare):
 *   - bf16: a 32-bit lane holds two weights; the even one is the lane shifted left by 16, the
 *     odd one the lane with its low half cleared (zero extension and a shift take two for 8);
 *     x split into its even and odd columns;
 *   - fp16: vcvtph2ps of each half; x split into the first and last 8 of every 16 columns.
 * Blocks of 2 weight rows x 4 x rows over KC columns: per 16 columns 2 weight loads, 4
 * widenings, 8 x loads and 16 FMAs into 8 accumulators (the row-at-a-time dot, frow1, widens
 * every weight again for each x row: 3 operations for 8 products). x rows go 4 at a time past
 * the item's weight rows, KC columns a pass, so the x block (16 KB) stays in L1 and the item's
 * rows (64 KB at K = 1024) in L2. */
#define PAIR_BLOCKS 1
#define PAIR_KC 1024
#ifndef PAIR_AHEAD
#define PAIR_AHEAD 2   /* weight rows ahead a pair prefetches into L1 (the next pair) ... */
#endif
#ifndef PAIR_L2_AHEAD
#define PAIR_L2_AHEAD 16384  /* ... and weight bytes ahead into L2, in whole rows (Zen 3, 4 rows an */
#endif                       /* expert: 0.89-0.92x the time at K = 512, 0.94-1.03x elsewhere) */

static inline __attribute__((always_inline)) void pair_block(const int wt, const int nr, const int nx,
                                                             const uint16_t *w, int64_t K, const float *xp, int64_t k0,
                                                             int64_t kn, int add, int prefetch, float *out, int64_t N) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t l2_rows = (PAIR_L2_AHEAD + 2 * K - 1) / (2 * K);
    __m256 acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + kn; k += 16) {
        if (prefetch && (k & 31) == 0)  /* the line PAIR_AHEAD rows ahead into L1, PAIR_L2_AHEAD bytes into L2 */
            for (int r = 0; r < nr; r++) {
                _mm_prefetch((const char *)(w + (r + PAIR_AHEAD) * K + k), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + (r + l2_rows) * K + k), _MM_HINT_T2);
            }
        __m256 we[2], wo[2];
        for (int r = 0; r < nr; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * K + k));
            if (wt == 1) {  /* bf16 */
                we[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                wo[r] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            } else {        /* fp16 */
                we[r] = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
                wo[r] = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
            }
        }
        for (int j = 0; j < nx; j++) {
            const float *xj = xp + j * K + k / 2;
            const __m256 xe = _mm256_loadu_ps(xj), xo = _mm256_loadu_ps(xj + K / 2);
            for (int r = 0; r < nr; r++) acc[r][j] = _mm256_fmadd_ps(wo[r], xo, _mm256_fmadd_ps(we[r], xe, acc[r][j]));
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < nx; j++) {
            const float v = vf_sum(acc[r][j]);
            out[j * N + r] = add ? out[j * N + r] + v : v;
        }
}

/* x rows xp (nx of them, 1-4) past weight rows [r0, r1) of ws, columns [k0, k0 + kn). */
static inline __attribute__((always_inline)) void pair_pass(const int wt, const int nx, const uint16_t *ws,
                                                            int64_t r0, int64_t r1, int64_t K, const float *xp,
                                                            int64_t k0, int64_t kn, int add, int prefetch, float *out,
                                                            int64_t N) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) pair_block(wt, 2, nx, ws + r * K, K, xp, k0, kn, add, prefetch, out + r, N);
    if (r < r1) pair_block(wt, 1, nx, ws + r * K, K, xp, k0, kn, add, prefetch, out + r, N);
}

/* pair_pass of weight type wt over the nx (1-4) x rows at xp. */
static inline __attribute__((always_inline)) void pair_passes(const int wt, int64_t nx, const uint16_t *ws,
                                                              int64_t r0, int64_t r1, int64_t K, const float *xp,
                                                              int64_t k0, int64_t kn, int add, int first, float *out,
                                                              int64_t N) {
    switch (nx) {
        case 4: pair_pass(wt, 4, ws, r0, r1, K, xp, k0, kn, add, first, out, N); break;
        case 3: pair_pass(wt, 3, ws, r0, r1, K, xp, k0, kn, add, first, out, N); break;
        case 2: pair_pass(wt, 2, ws, r0, r1, K, xp, k0, kn, add, first, out, N); break;
        default: pair_pass(wt, 1, ws, r0, r1, K, xp, k0, kn, add, first, out, N); break;
    }
}

/* A work item of a 16-bit call with prepared x rows: KC columns at a time; in each pass the
 * segment's x rows go 4 at a time (in L1) past the item's weight rows (in L2 after the first
 * four, which stream them from memory), two at a time. */
static void pair_item(const float_call *c, const work_item *it) {
    const int64_t N = c->N, K = c->K;
    const uint16_t *ws = (const uint16_t *)c->w + c->experts[it->s] * N * K;
    for (int64_t k0 = 0; k0 < K; k0 += PAIR_KC) {
        const int64_t kn = K - k0 < PAIR_KC ? K - k0 : PAIR_KC;
        for (int64_t j = it->j0; j < it->j1; j += 4) {
            const float *xp = c->xp + j * K;
            float *out = c->out + j * N;
            const int add = k0 > 0, first = j == it->j0;
            const int64_t nx = it->j1 - j >= 4 ? 4 : it->j1 - j;
            if (c->wtype == 1) pair_passes(1, nx, ws, it->r0, it->r1, K, xp, k0, kn, add, first, out, N);
            else pair_passes(2, nx, ws, it->r0, it->r1, K, xp, k0, kn, add, first, out, N);
        }
    }
}

/* Row x split as pair_block widens weights of type wt (K a multiple of 16): bf16 its even and
 * odd columns; fp16 the first and the last 8 of each 16 columns. */
static void pair_prepare(int wt, const float *x, int64_t K, float *xp) {
    if (wt == 1)
        for (int64_t k = 0; k < K / 2; k++) xp[k] = x[2 * k], xp[K / 2 + k] = x[2 * k + 1];
    else
        for (int64_t k = 0; k < K; k += 16)
            for (int i = 0; i < 8; i++) xp[k / 2 + i] = x[k + i], xp[K / 2 + k / 2 + i] = x[k + 8 + i];
}
#endif

/* Work item `item` (a segment's block of ROWS weight rows) of a float call. */
static void float_item(const float_call *c, int64_t item) {
    const int64_t N = c->N, K = c->K, row_bytes = c->row_bytes;
    const work_item it = item_of(item, c->blocks, c->starts, N);
    const char *ws = (const char *)c->w + c->experts[it.s] * N * row_bytes;
    int64_t r = it.r0;
#ifdef PAIR_BLOCKS
    if (c->xp && it.j1 - it.j0 >= 2) {
        pair_item(c, &it);
        return;
    }
#endif
#if FOUR_ROWS
    if (FOUR_A_PASS(it.j1 - it.j0))
    for (; r + 4 <= it.r1; r += 4)
        for (int64_t j = it.j0; j < it.j1; j++)
            frows4(c->wtype, ws + r * row_bytes, row_bytes, K, c->x + (c->x_stride ? j * c->x_stride : 0), c->out + j * N + r);
#endif
    for (; r < it.r1; r++) {
        prefetch_row_ahead(ws + r * row_bytes, row_bytes);
        for (int64_t j = it.j0; j < it.j1; j++)
            c->out[j * N + r] = frow1(c->wtype, ws + r * row_bytes, K, c->x + (c->x_stride ? j * c->x_stride : 0));
    }
}

/* Whether moekit_float_gemm_segments takes 16-bit weights past several x rows in pair blocks
 * in this build (AVX2 and F16C without AVX-512). */
int moekit_pair_blocks(void) {
#ifdef PAIR_BLOCKS
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or 2 for a bad wtype. */
int moekit_float_gemm_segments(int wtype, const void *w, const int64_t *experts, const int64_t *starts,
                               int64_t segments, const float *x, int64_t x_stride, int64_t N, int64_t K,
                               float *out, int threads) {
    if (wtype < 0 || wtype > 2) return 2;
    const int64_t row_bytes = K * (wtype == 0 ? 4 : 2);
    float_call c = {wtype, w, experts, starts, x, x_stride, N, K, row_bytes, (N + ROWS - 1) / ROWS, out, NULL};
#ifdef PAIR_BLOCKS
    /* 16-bit weights and x rows of their own: pair blocks, on x split once (without the memory:
     * the row-at-a-time path) */
    const int64_t x_rows = x_stride && starts ? starts[segments] : 0;
    float *xp = wtype != 0 && K % 16 == 0 && x_rows > segments
                    ? (float *)aligned_alloc(64, (size_t)(x_rows * K * 4 + 63) / 64 * 64) : NULL;
    c.xp = xp;
#endif
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef PAIR_BLOCKS
        if (xp) {
            OMP_FOR
            for (int64_t j = 0; j < x_rows; j++) pair_prepare(wtype, x + j * x_stride, K, xp + j * K);
        }
#endif
        OMP_FOR
        for (int64_t item = 0; item < segments * c.blocks; item++) float_item(&c, item);
    }
#ifdef PAIR_BLOCKS
    free(xp);
#endif
    (void)threads;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * bf16 rows against bf16 weights by vdpbf16ps (AVX-512 BF16), for sorted calls of many rows an
 * expert on CPUs whose bf16 GEMMs have no AMX tiles (AMD Zen 4 / 5): each vdpbf16ps multiplies
 * 32 bf16 pairs into 16 fp32 lanes, twice the products of an fp32 FMA on widened weights.
 * Blocks of 4 weight rows x 4 x rows keep 16 accumulators (16 products a K step from 8 loads);
 * an item's x rows go 4 at a time past its BF16_ROWS weight rows, BF16_KC columns a pass, so
 * both stay in L1. Each output is an fp32 sum of its K products (the lanes' partial sums added
 * at the end of each pass).
 * Returns 0, or 4 where this build has no AVX-512 BF16. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT 1

#ifndef BF16_KC
#define BF16_KC 1024   /* columns of one pass over an item's weight rows (16 rows: 32 KB, in L1) */
#endif
#ifndef BF16_ROWS
#define BF16_ROWS 16   /* weight rows of one work item */
#endif

/* nr (4 or 1) weight rows w (row stride ws) against nx (4 or 1) x rows (stride xs) over kn
 * columns: out[j * N + r] = (add ? out[j * N + r] : 0) + the products. */
static inline __attribute__((always_inline)) void bf16_block(const int nr, const int nx, const uint16_t *w,
                                                             int64_t ws, const uint16_t *x, int64_t xs, int64_t kn,
                                                             int add, float *out, int64_t N) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= kn; k += 32) {
        __m512bh wv[4], xv[4];
        for (int r = 0; r < nr; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ws + k);
        for (int j = 0; j < nx; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * xs + k);
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < nx; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv[j]);
    }
    if (k < kn) {  /* the last kn % 32 columns, the rest of the vectors zeros */
        const __mmask32 m = (__mmask32)((1u << (kn - k)) - 1);
        __m512bh wv[4], xv[4];
        for (int r = 0; r < nr; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * ws + k);
        for (int j = 0; j < nx; j++) xv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + j * xs + k);
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < nx; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv[j]);
    }
    for (int j = 0; j < nx; j++) {
        float *o = out + j * N;
        if (nr == 4) {
            const __m128 v = sum4x16(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
            _mm_storeu_ps(o, add ? _mm_add_ps(_mm_loadu_ps(o), v) : v);
        } else {
            const float v = _mm512_reduce_add_ps(acc[0][j]);
            o[0] = add ? o[0] + v : v;
        }
    }
}

/* A bf16 call's weights: bf16 rows (wtype -1), or weight-only ones (wtype as wo_call's: 0 int4,
 * 1 int8, 2 uint8 with zero points; scale / zero [E, N, K / g]) dequantized to bf16 a block at a
 * time into the calling thread's scratch. */
typedef struct {
    const uint16_t *w, *x;
    const int64_t *experts, *starts;
    int64_t x_stride, N, K, blocks;
    float *out;
    int wtype;
    const uint8_t *q, *zero;
    const float *scale;
    int64_t g;
} bf16_call;

/* kn columns from k0 (both multiples of 32, as g) of weight-only row q (its scales sc and
 * zero points z, a group each) as bf16: (q - z) s rounded to nearest even. */
static void wo_row_bf16(int wtype, const uint8_t *q, const float *sc, const uint8_t *z, int64_t g, int64_t k0,
                        int64_t kn, uint16_t *dst) {
    const __m128i nib = _mm_set1_epi8(15);
    for (int64_t k = 0; k < kn; k += 32) {
        const int64_t col = k0 + k, c = col / g;
        const __m512 s = _mm512_set1_ps(sc[c]);
        const __m512 zf = _mm512_set1_ps(z ? (float)z[c] : (wtype == 0 ? 8.0f : 0.0f));
        __m512i v0, v1;  /* the 32 columns' stored values, in column order */
        if (wtype == 0) {  /* even columns in the low nibbles */
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + col / 2));
            const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
            v0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), v1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
        } else if (wtype == 1) {
            v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + col)));
            v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + col + 16)));
        } else {
            v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + col)));
            v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + col + 16)));
        }
        const __m512 f0 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v0), zf), s);
        const __m512 f1 = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(v1), zf), s);
        _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(f0));
        _mm256_storeu_si256((__m256i *)(dst + k + 16), (__m256i)_mm512_cvtneps_pbh(f1));
    }
}

/* Weight rows [r0, r1) of expert e, columns [k0, k0 + kn), as bf16 rows of stride *ws: the
 * weights themselves, or dequantized into scratch. */
static const uint16_t *bf16_rows(const bf16_call *c, int64_t e, int64_t r0, int64_t r1, int64_t k0, int64_t kn,
                                 uint16_t *scratch, int64_t *ws) {
    const int64_t N = c->N, K = c->K;
    if (c->wtype < 0) {
        *ws = K;
        return c->w + (e * N + r0) * K + k0;
    }
    const int64_t G = K / c->g, row_bytes = c->wtype == 0 ? K / 2 : K;
    for (int64_t r = r0; r < r1; r++)
        wo_row_bf16(c->wtype, c->q + (e * N + r) * row_bytes, c->scale + (e * N + r) * G,
                    c->zero ? c->zero + (e * N + r) * G : NULL, c->g, k0, kn, scratch + (r - r0) * kn);
    *ws = kn;
    return scratch;
}

/* rows x nx (4 or 1) x rows from xj (stride xs) into o (stride N): bf16_block over the rows. */
static inline void bf16_rows_x(const uint16_t *w, int64_t ws, int64_t rows, const int nx, const uint16_t *xj,
                               int64_t xs, int64_t kn, int add, float *o, int64_t N) {
    int64_t r = 0;
    if (nx == 4) {
        for (; r + 4 <= rows; r += 4) bf16_block(4, 4, w + r * ws, ws, xj, xs, kn, add, o + r, N);
        for (; r < rows; r++) bf16_block(1, 4, w + r * ws, ws, xj, xs, kn, add, o + r, N);
    } else {
        for (; r + 4 <= rows; r += 4) bf16_block(4, 1, w + r * ws, ws, xj, 0, kn, add, o + r, N);
        for (; r < rows; r++) bf16_block(1, 1, w + r * ws, ws, xj, 0, kn, add, o + r, N);
    }
}

/* Work item `item`: segment item / blocks, weight rows [r0, r0 + BF16_ROWS); BF16_KC columns a
 * pass, four x rows at a time (in L1 while the item's weight rows, in L1 too, pass them). */
static void bf16_item(const bf16_call *c, int64_t item, uint16_t *scratch) {
    const int64_t N = c->N, K = c->K, xs = c->x_stride, s = item / c->blocks, e = c->experts[s];
    const int64_t r0 = (item % c->blocks) * BF16_ROWS, r1 = r0 + BF16_ROWS < N ? r0 + BF16_ROWS : N;
    const int64_t j0 = seg_begin(c->starts, s), j1 = seg_begin(c->starts, s + 1);
    if (j1 == j0) return;
    for (int64_t k0 = 0; k0 < K; k0 += BF16_KC) {
        const int64_t kn = K - k0 < BF16_KC ? K - k0 : BF16_KC;
        int64_t ws;
        const uint16_t *w = bf16_rows(c, e, r0, r1, k0, kn, scratch, &ws);
        for (int64_t j = j0; j < j1;) {
            const int nx = j1 - j >= 4 ? 4 : 1;
            bf16_rows_x(w, ws, r1 - r0, nx, c->x + j * xs + k0, xs, kn, k0 > 0, c->out + j * N + r0, N);
            j += nx;
        }
    }
}
#endif

#ifdef BF16_DOT
typedef struct gate_up_call gate_up_call;
static void gate_up_item(const gate_up_call *c, int64_t item, float *h, uint16_t *scratch);

/* Runs the items of c (or, given gu, of that gated GEMM1) over threads, each thread with a
 * scratch of `scratch` bf16 values and of `h` floats; returns 1 when one could not be allocated. */
static int bf16_run(const bf16_call *c, const gate_up_call *gu, int64_t items, int64_t scratch, int64_t h,
                    int threads) {
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        uint16_t *sc = (uint16_t *)malloc((size_t)(scratch > 0 ? scratch : 1) * sizeof(uint16_t));
        float *hb = (float *)malloc((size_t)(h > 0 ? h : 1) * sizeof(float));
        if (sc == NULL || hb == NULL) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
        OMP_FOR_DYNAMIC
        for (int64_t item = 0; item < items; item++)
            if (sc != NULL && hb != NULL) {
                if (gu) gate_up_item(gu, item, hb, sc);
                else bf16_item(c, item, sc);
            }
        free(sc);
        free(hb);
    }
    (void)threads;
    return failed;
}
#endif

/* The weights of a bf16 call: w bf16 [E, N, K] (wtype -1), or weight-only q with scale / zero
 * [E, N, K / g] (wtype 0 int4, 1 int8, 2 uint8; g a multiple of 32 dividing K). */
int moekit_bf16_gemm_segments(int wtype, const void *w, const float *scale, const uint8_t *zero, int64_t g,
                              const int64_t *experts, const int64_t *starts, int64_t segments, const uint16_t *x,
                              int64_t x_stride, int64_t N, int64_t K, float *out, int threads) {
#ifdef BF16_DOT
    if (wtype < -1 || wtype > 2 || (wtype >= 0 && (g <= 0 || g % 32 || K % g))) return 2;
    const bf16_call c = {(const uint16_t *)w, x, experts, starts, x_stride, N, K, (N + BF16_ROWS - 1) / BF16_ROWS, out,
                         wtype, (const uint8_t *)w, zero, scale, g};
    return bf16_run(&c, NULL, segments * c.blocks, wtype >= 0 ? BF16_ROWS * BF16_KC : 0, 0, threads);
#else
    (void)wtype, (void)w, (void)scale, (void)zero, (void)g, (void)experts, (void)starts, (void)segments, (void)x,
        (void)x_stride, (void)N, (void)K, (void)out, (void)threads;
    return 4;
#endif
}

/* Whether moekit_bf16_gemm_segments multiplies in this build. */
int moekit_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * moekit_decode: each decode token's whole experts FFN in one parallel region, all tokens in one call:
 *
 *     h_j = W13[e_j] x_j (+ b13_j),  a_j = act(h_j),  y_j = W2[e_j] a_j (+ b2_j),
 *     out = sum_j c_j y_j  (slot order; c_j = w_j, or 1 with x_j = w_j x: weights on the input)
 *
 * for the token's n slots j (experts e_j), each GEMM on the kernels above (float, int8 W8A8 or
 * weight-only weights, one `moekit_projection` each). At decode a layer is a weight stream
 * plus a dozen small operations, and between two streams those ran cold (caches and the
 * interpreter's state evicted by the weights, h and y written by the other core): about
 * 150-250 us a token on two cores, a quarter of an int4 layer's time. Here the activation of
 * slot j runs on the thread that computed h_j, the threads meet at a barrier between the
 * steps, and nothing returns to Python in between.
 * ------------------------------------------------------------------------------------------- */
typedef struct {    /* one projection's weights, as moekit/native/__init__.py lays it out */
    int32_t kind;   /* 0: float weights (wtype 0 fp32, 1 bf16, 2 fp16) */
                    /* 1: int8 W8A8 (scale [E, N] per output channel, x quantized per row) */
                    /* 2: weight-only (wtype 0 int4, 1 int8, 2 uint8 with zero; scale [E, N, K/g]) */
    int32_t wtype;
    const void *w;
    const float *scale;
    const uint8_t *zero;
    int64_t N, K, g;
} moekit_projection;

/* A product of any kind over one segment a row (a decode token's slots). */
typedef struct {
    int kind;
    float_call fl;
    int8_call i8;
    wo_call wo;
    int32_t *xsum;  /* int8: the x rows' xq_vector_sums, then the rows (xq) and their scales */
    xq_t *xq;
    float *scales;
    const float *x;
    int64_t x_stride, items;
} product;

static int product_init(product *p, const moekit_projection *d, const int64_t *experts, int64_t segments,
                        const float *x, int64_t x_stride, int64_t x_rows, float *out) {
    memset(p, 0, sizeof *p);
    p->kind = d->kind, p->x = x, p->x_stride = x_stride;
    const int64_t blocks = (d->N + ROWS - 1) / ROWS;
    p->items = segments * blocks;
    if (d->kind == 0) {
        const float_call c = {d->wtype, d->w, experts, NULL, x, x_stride, d->N, d->K, d->K * (d->wtype == 0 ? 4 : 2),
                              blocks, out, NULL};
        p->fl = c;
        return 1;
    }
    if (d->kind == 1) {
        p->xsum = (int32_t *)malloc((size_t)x_rows * (sizeof(int32_t) + sizeof(float))
                                    + (size_t)(x_rows * d->K) * sizeof(xq_t));
        if (p->xsum == NULL) return 0;
        p->scales = (float *)(p->xsum + x_rows);
        p->xq = (xq_t *)(p->scales + x_rows);
        const int8_call c = {(const int8_t *)d->w, experts, NULL, p->xq, p->xsum, p->scales, d->scale, x_stride == 0,
                             d->N, d->K, blocks, NULL, out, 0};
        p->i8 = c;
        return 1;
    }
    wo_call *c = &p->wo;
    c->wtype = d->wtype, c->w = (const uint8_t *)d->w, c->zero = d->zero, c->scale = d->scale, c->x = x;
    c->experts = experts, c->x_stride = x_stride, c->N = d->N, c->K = d->K, c->g = d->g, c->out = out;
    return wo_init(c, x_rows);
}

static void product_prepare_row(product *p, int64_t j) {
    if (p->kind == 1)
        quantize_row(p->x + j * p->x_stride, p->i8.K, p->xq + j * p->i8.K, p->scales + j, p->xsum + j);
    else if (p->kind == 2) wo_prepare_row(&p->wo, j);
}

static void product_item(const product *p, int64_t item) {
    if (p->kind == 0) float_item(&p->fl, item);
    else if (p->kind == 1) int8_item(&p->i8, item);
    else wo_item(&p->wo, item);
}

static void product_free(product *p) {
    free(p->xsum);
    if (p->kind == 2 && p->wo.scratch) wo_free(&p->wo);
}

/* The activations of moekit.activations, in the order of its ACTIVATIONS (the GATED_ACTS gated
 * ones take h = [gate | up] of 2 I values, the others I), computed as torch's CPU kernels write them. */
#define GATED_ACTS 6
#define NUM_ACTS 9
static inline float activate1(int act, float alpha, float limit, float g, float u) {
    switch (act) {
    case 0: return (g / (1.0f + expf(-g))) * u;                                                /* silu */
    case 1: return ((g * 0.5f) * (1.0f + erff(g * 0.70710678118654752f))) * u;                 /* gelu */
    case 2: {                                                                                  /* gelu_tanh */
        const float inner = 0.79788456080286536f * (g + 0.044715f * (g * g * g));
        return ((0.5f * g) * (1.0f + tanhf(inner))) * u;
    }
    case 3: {                                                                                  /* swigluoai */
        g = g > limit ? limit : g;  /* NaN stays NaN, as in torch's clamp */
        const float up = u > limit ? limit : (u < -limit ? -limit : u);
        return (g * (1.0f / (1.0f + expf(-(alpha * g))))) * (up + 1.0f);
    }
    case 4: {                                                                                  /* swiglu_limit */
        g = g > limit ? limit : g;
        const float up = u > limit ? limit : (u < -limit ? -limit : u);
        return (g / (1.0f + expf(-g))) * up;
    }
    case 5: {                                                                                  /* swiglustep */
        const float s = g / (1.0f + expf(-g));
        const float up = u > limit ? limit : (u < -limit ? -limit : u);
        return (s > limit ? limit : s) * up;
    }
    case 6: return g / (1.0f + expf(-g));                                                      /* silu_no_mul */
    case 7: return (g * 0.5f) * (1.0f + erff(g * 0.70710678118654752f));                       /* gelu_no_mul */
    default: { const float r = g < 0.0f ? 0.0f : g; return r * r; }                           /* relu2_no_mul */
    }
}

#ifdef __AVX512F__
/* e^x on 16 lanes: 2^(x log2 e) as 2^n 2^f, f in [-1/2, 1/2] by a degree-7 polynomial (relative
 * error about 2e-7); beyond fp32's range inf or 0, NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    t = _mm512_max_ps(_mm512_set1_ps(-160.0f), _mm512_min_ps(_mm512_set1_ps(160.0f), t));  /* NaN passes */
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The gated activation of 16 lanes (silu, swigluoai and swiglu_limit as vectors, the others lane by lane). */
static inline __m512 activate16(int act, float alpha, float limit, __m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == 0)  /* silu: g / (1 + e^-g) times u */
        return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
    if (act == 3 || act == 4) {  /* swigluoai / swiglu_limit: g clamped above, u both ways (NaN passes, as torch's) */
        const __m512 lim = _mm512_set1_ps(limit);
        g = _mm512_min_ps(lim, g);
        u = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, u));
        if (act == 4)  /* silu(g) times u */
            return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
        const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_mul_ps(_mm512_set1_ps(-alpha), g))));
        return _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_add_ps(u, one));
    }
    float gs[16], us[16];
    _mm512_storeu_ps(gs, g), _mm512_storeu_ps(us, u);
    for (int i = 0; i < 16; i++) gs[i] = activate1(act, alpha, limit, gs[i], us[i]);
    return _mm512_loadu_ps(gs);
}
#endif

/* a [I] = the activation of h (gated: [gate | up], 2 I values): silu, swigluoai, swiglu_limit (and silu
 * alone) 16 lanes a step on the vector exp where the build has AVX-512, the rest lane by lane. */
static void activate(int act, float alpha, float limit, const float *h, int64_t I, float *a) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (act == 0 || act == 3 || act == 4 || act == 6)
        for (; i + 16 <= I; i += 16) {
            const __m512 u = act == 6 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(h + I + i);
            _mm512_storeu_ps(a + i, activate16(act == 6 ? 0 : act, alpha, limit, _mm512_loadu_ps(h + i), u));
        }
#endif
    for (; i < I; i++) a[i] = activate1(act, alpha, limit, h[i], act < GATED_ACTS ? h[I + i] : 0.0f);
}

#ifdef BF16_DOT

struct gate_up_call {
    bf16_call gemm;  /* w13 [E, 2I, K], x, experts, starts; N = 2I, blocks over I */
    int64_t I;
    int act;
    float alpha, limit;
    const float *b13;  /* [E, 2I] or NULL */
    uint16_t *a;       /* [R, I] bf16 */
};

/* Work item `item`: segment item / blocks, activation columns [c0, c0 + 16): the gate rows c0..
 * and the up rows I + c0.. against the segment's x rows into h [rows, 32] (gate 16, up 16),
 * BF16_KC columns a pass as bf16_item, then the biases and the activation, rounded to bf16. */
static void gate_up_item(const gate_up_call *c, int64_t item, float *h, uint16_t *scratch) {
    const bf16_call *g = &c->gemm;
    const int64_t I = c->I, K = g->K, xs = g->x_stride, s = item / g->blocks, e = g->experts[s];
    const int64_t c0 = (item % g->blocks) * 16, nc = I - c0 < 16 ? I - c0 : 16;
    const int64_t j0 = seg_begin(g->starts, s), j1 = seg_begin(g->starts, s + 1);
    if (j1 == j0) return;
    for (int64_t k0 = 0; k0 < K; k0 += BF16_KC) {
        const int64_t kn = K - k0 < BF16_KC ? K - k0 : BF16_KC;
        int64_t wsg, wsu;
        const uint16_t *wg = bf16_rows(g, e, c0, c0 + nc, k0, kn, scratch, &wsg);
        const uint16_t *wu = bf16_rows(g, e, I + c0, I + c0 + nc, k0, kn, scratch + 16 * BF16_KC, &wsu);
        for (int64_t j = j0; j < j1;) {
            const int nx = j1 - j >= 4 ? 4 : 1;
            const uint16_t *xj = g->x + j * xs + k0;
            float *o = h + (j - j0) * 32;
            bf16_rows_x(wg, wsg, nc, nx, xj, xs, kn, k0 > 0, o, 32);
            bf16_rows_x(wu, wsu, nc, nx, xj, xs, kn, k0 > 0, o + 16, 32);
            j += nx;
        }
    }
    const __mmask16 m = (__mmask16)((1u << nc) - 1);
    const __m512 bg = c->b13 ? _mm512_maskz_loadu_ps(m, c->b13 + e * 2 * I + c0) : _mm512_setzero_ps();
    const __m512 bu = c->b13 ? _mm512_maskz_loadu_ps(m, c->b13 + e * 2 * I + I + c0) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const float *hj = h + (j - j0) * 32;
        const __m512 v = activate16(c->act, c->alpha, c->limit, _mm512_add_ps(_mm512_maskz_loadu_ps(m, hj), bg),
                                    _mm512_add_ps(_mm512_maskz_loadu_ps(m, hj + 16), bu));
        _mm256_mask_storeu_epi16(c->a + j * I + c0, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

/* Gated GEMM1 of sorted bf16 rows with its activation, on vdpbf16ps: a[j] = bf16(act(W13[e] x[j]
 * + b13[e])) for the rows j of each segment (expert e), fp32 sums and activation (silu and
 * swigluoai, swiglu_limit vectorized; exp within 2e-7 of expf); act 0-4 (the gated ones), I = w13's rows / 2.
 * Returns 0, 1 when the scratch cannot be allocated, 2 for a non-gated act, 4 without AVX-512
 * BF16. */
int moekit_bf16_gate_up_segments(int wtype, const void *w13, const float *scale, const uint8_t *zero, int64_t g,
                                 const int64_t *experts, const int64_t *starts, int64_t segments, const uint16_t *x,
                                 int64_t x_stride, int64_t I, int64_t K, int act, float alpha, float limit,
                                 const float *b13, uint16_t *a, int threads) {
#ifdef BF16_DOT
    if (act < 0 || act >= GATED_ACTS || wtype < -1 || wtype > 2 || (wtype >= 0 && (g <= 0 || g % 32 || K % g))) return 2;
    int64_t most = 0;
    for (int64_t s = 0; s < segments; s++) {
        const int64_t n = seg_begin(starts, s + 1) - seg_begin(starts, s);
        most = n > most ? n : most;
    }
    const gate_up_call c = {{(const uint16_t *)w13, x, experts, starts, x_stride, 2 * I, K, (I + 15) / 16, NULL, wtype,
                             (const uint8_t *)w13, zero, scale, g},
                            I, act, alpha, limit, b13, a};
    return bf16_run(&c.gemm, &c, segments * c.gemm.blocks, wtype >= 0 ? 32 * BF16_KC : 0, most * 32, threads);
#else
    (void)wtype, (void)w13, (void)scale, (void)zero, (void)g, (void)experts, (void)starts, (void)segments, (void)x,
        (void)x_stride, (void)I, (void)K, (void)act, (void)alpha, (void)limit, (void)b13, (void)a, (void)threads;
    return 4;
#endif
}

/* One token's FFN over its n local slots (experts[j], slot_w[j]); b13 [E, N1] and b2 [E, H]
 * fp32 bias tables or NULL. Returns 0, or 1 when the scratch cannot be allocated. */
static int decode_token(const moekit_projection *p13, const moekit_projection *p2, int act, float alpha,
                        float limit, const int64_t *experts, const float *slot_w, int64_t n, int on_input,
                        const float *x, const float *b13, const float *b2, float *out, int threads) {
    const int64_t H = p13->K, N1 = p13->N, I = p2->K;
    const int64_t x_rows = on_input ? n : 1, nx = on_input ? n * H : 0;
    float *buf = (float *)malloc((size_t)(nx + n * (N1 + I + H)) * sizeof(float));
    if (buf == NULL) return 1;
    float *h = buf + nx, *a = h + n * N1, *y = a + n * I;
    product g1, g2;
    const int ok1 = product_init(&g1, p13, experts, n, on_input ? buf : x, on_input ? H : 0, x_rows, h);
    const int ok2 = ok1 && product_init(&g2, p2, experts, n, a, I, n, y);
    if (!ok2) {
        if (ok1) product_free(&g1);
        free(buf);
        return 1;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        OMP_FOR
        for (int64_t j = 0; j < x_rows; j++) {
            if (on_input)
                for (int64_t k = 0; k < H; k++) buf[j * H + k] = x[k] * slot_w[j];
            product_prepare_row(&g1, j);
        }
        OMP_FOR
        for (int64_t item = 0; item < g1.items; item++) product_item(&g1, item);
        OMP_FOR
        for (int64_t j = 0; j < n; j++) {  /* static: slot j on the thread that computed most of h_j */
            float *hj = h + j * N1;
            if (b13)
                for (int64_t k = 0; k < N1; k++) hj[k] += b13[experts[j] * N1 + k];
            activate(act, alpha, limit, hj, I, a + j * I);
            product_prepare_row(&g2, j);
        }
        OMP_FOR
        for (int64_t item = 0; item < g2.items; item++) product_item(&g2, item);
        OMP_FOR
        for (int64_t c0 = 0; c0 < H; c0 += 256) {
            const int64_t c1 = c0 + 256 < H ? c0 + 256 : H;
            for (int64_t c = c0; c < c1; c++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    const float v = b2 ? y[j * H + c] + b2[experts[j] * H + c] : y[j * H + c];
                    acc += on_input ? v : slot_w[j] * v;
                }
                out[c] = acc;
            }
        }
    }
    product_free(&g1);
    product_free(&g2);
    free(buf);
    (void)threads;
    return 0;
}

/* Decode of T tokens, token by token: ids [T, k] (int32, or int64 with ids_int64), topk_w
 * [T, k] fp32, expert_map [map_size] (int32, or int64 with map_int64; -1: elsewhere) or NULL, x
 * [T, H] fp32, out [T, H] fp32 (a token without local slots gets zeros). E: the local experts
 * the projections hold. Returns 0; 1 when scratch cannot be allocated; 2 for shapes that do
 * not fit together; 3 for an id outside [0, map_size or E) or a mapped id outside [-1, E). */
int moekit_decode(const moekit_projection *p13, const moekit_projection *p2, int act, float alpha, float limit,
                  const void *ids, int ids_int64, const float *topk_w, int64_t T, int64_t k, const void *expert_map,
                  int map_int64, int64_t map_size, int64_t E, int on_input, const float *x, const float *b13, const float *b2,
                  float *out, int threads) {
    const int64_t H = p13->K;
    if (act < 0 || act >= NUM_ACTS || p2->N != H || p13->N != (act < GATED_ACTS ? 2 * p2->K : p2->K) || k <= 0)
        return 2;
    int64_t *experts = (int64_t *)malloc((size_t)k * (sizeof(int64_t) + sizeof(float)));
    if (experts == NULL) return 1;
    float *slot_w = (float *)(experts + k);
    int rc = 0;
    for (int64_t t = 0; t < T && rc == 0; t++) {
        int64_t n = 0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t id = ids_int64 ? ((const int64_t *)ids)[t * k + j] : ((const int32_t *)ids)[t * k + j];
            if (id < 0 || id >= (expert_map ? map_size : E)) { rc = 3; break; }
            const int64_t e = !expert_map ? id
                              : (map_int64 ? ((const int64_t *)expert_map)[id] : ((const int32_t *)expert_map)[id]);
            if (e < -1 || e >= E) { rc = 3; break; }
            if (e >= 0) experts[n] = e, slot_w[n++] = topk_w[t * k + j];
        }
        if (rc) break;
        if (n == 0) memset(out + t * H, 0, (size_t)H * sizeof(float));
        else rc = decode_token(p13, p2, act, alpha, limit, experts, slot_w, n, on_input, x + t * H, b13, b2, out + t * H,
                               threads);
    }
    free(experts);
    return rc;
}

