/* The int8, int4 and fp8 codecs of agent/core/codecs.py for fp16 blocks, in C (AVX2 +
   F16C where the compiler targets them, plain C otherwise). Bit for bit what the torch
   path computes on finite blocks. A NaN anywhere in a row (or int4 group) makes its scale
   NaN, as an infinity makes it infinite, so codecs.py refuses the block from its stored
   scales. int8: per row of head_dim values, scale = max(absmax, 1e-8) / 127 in fp32, as the fp16 it
   is stored as (half_up), q = round half to even of x / scale (a true division, as torch
   does), clamped to [-127, 127]. Decode: q * fp16 scale in fp32, rounded to fp16. int4 (KIVI) and
   fp8: see their sections. Built and loaded by protos.native. */

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__GNUC__) && !defined(__clang__)
/* decode's q * scale + min is two fp32 roundings in torch: never one fused multiply-add */
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VEC 1
#endif

#ifdef VEC
/* max of magnitudes (sign bits clear) compared as integers: the same order as floats,
   with a NaN above infinity, so a NaN is kept (a float max drops it) */
static inline __m256 mag_max(__m256 x, __m256 y) {
    return _mm256_castsi256_ps(_mm256_max_epi32(_mm256_castps_si256(x), _mm256_castps_si256(y)));
}
#endif

/* the largest |v[j]|; NaN when a v[j] is NaN */
static inline float row_absmax(const _Float16 *v, int64_t d) {
    float m = 0.f;
    int64_t j = 0;
#ifdef VEC
    __m256 acc = _mm256_setzero_ps();
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (; j + 8 <= d; j += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j)));
        acc = mag_max(acc, _mm256_and_ps(a, nosign));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) m = (lanes[k] > m || lanes[k] != lanes[k]) ? lanes[k] : m;
#endif
    for (; j < d; j++) {
        float a = fabsf((float)v[j]);
        m = (a > m || a != a) ? a : m; /* once NaN, m stays NaN */
    }
    return m;
}

/* s (> 0, or NaN: kept) as the fp16 a scale is stored as: the nearest, or, where that is
   an fp16 subnormal below s, the next one up (there its rounding error is a large part of
   it, and values quantized with it would clamp) */
static inline _Float16 half_up(float s) {
    _Float16 h = (_Float16)s;
    if ((float)h < s && (float)h < 0x1p-14f) {
        uint16_t bits;
        memcpy(&bits, &h, 2);
        bits++;
        memcpy(&h, &bits, 2);
    }
    return h;
}

/* a row's scale, max(absmax, 1e-8) / qmax in fp32, as the fp16 it is stored as
   (half_up); values are quantized with that stored scale, the one decode multiplies by
   (an fp16 subnormal scale is far from the fp32 one: quantizing with the latter cost up
   to qmax steps of its rounding error) */
static inline float row_scale(const _Float16 *v, int64_t d, float qmax, _Float16 *stored) {
    float m = row_absmax(v, d);
    float s = (m > 1e-8f || m != m ? m : 1e-8f) / qmax;
    *stored = half_up(s);
    return (float)*stored;
}

#ifdef VEC
/* max over each 128-bit half's adjacent pairs of x and y: [x0|x1, x2|x3, y0|y1, y2|y3] per half (hadd's order) */
static inline __m256 hmax2(__m256 x, __m256 y) {
    return mag_max(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD));
}

/* the absmax of 8 rows of d values (d a multiple of 8), one row per lane: the rows'
   maxima are reduced together instead of one horizontal reduction per row */
static inline __m256 rows8_absmax(const _Float16 *v, int64_t d) {
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 acc[8];
    for (int i = 0; i < 8; i++) {
        const _Float16 *row = v + i * d;
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8)
            a = mag_max(a, _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + j))), nosign));
        acc[i] = a;
    }
    __m256 m0123 = hmax2(hmax2(acc[0], acc[1]), hmax2(acc[2], acc[3]));
    __m256 m4567 = hmax2(hmax2(acc[4], acc[5]), hmax2(acc[6], acc[7]));
    return mag_max(_mm256_permute2f128_ps(m0123, m4567, 0x20), _mm256_permute2f128_ps(m0123, m4567, 0x31));
}
#endif

#ifdef VEC
/* the scales max(absmax, 1e-8) / qmax of 8 rows (d a multiple of 8), as the fp16 they are
   stored as: row_scale's arithmetic, one division and one conversion for the 8 */
static inline __m256 rows8_scale(const _Float16 *v, int64_t d, float qmax, _Float16 *stored) {
    /* max_ps answers its second operand when either is NaN: a NaN absmax stays NaN */
    __m256 sv = _mm256_div_ps(_mm256_max_ps(_mm256_set1_ps(1e-8f), rows8_absmax(v, d)), _mm256_set1_ps(qmax));
    __m128i h = _mm256_cvtps_ph(sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* a subnormal below s: one up (the lanes' -1 masks, packed to 16 bits, subtracted) */
    __m256 back = _mm256_cvtph_ps(h);
    __m256i below = _mm256_castps_si256(_mm256_and_ps(_mm256_cmp_ps(back, sv, _CMP_LT_OQ),
                                                      _mm256_cmp_ps(back, _mm256_set1_ps(0x1p-14f), _CMP_LT_OQ)));
    h = _mm_sub_epi16(h, _mm_packs_epi32(_mm256_castsi256_si128(below), _mm256_extracti128_si256(below, 1)));
    _mm_storeu_si128((__m128i *)stored, h);
    return _mm256_cvtph_ps(h);
}
#endif

/* q of one row with its fp32 scale s */
static inline void int8_row(const _Float16 *v, int64_t d, float s, int8_t *o) {
    int64_t j = 0;
#ifdef VEC
        const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
        for (; j + 16 <= d; j += 16) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j)));
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j + 8)));
            a = _mm256_round_ps(_mm256_div_ps(a, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            b = _mm256_round_ps(_mm256_div_ps(b, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            a = _mm256_min_ps(_mm256_max_ps(a, lo), hi);
            b = _mm256_min_ps(_mm256_max_ps(b, lo), hi);
            __m256i ia = _mm256_cvtps_epi32(a), ib = _mm256_cvtps_epi32(b);
            __m256i p16 = _mm256_packs_epi32(ia, ib);               /* a0-3 b0-3 a4-7 b4-7 */
            p16 = _mm256_permute4x64_epi64(p16, 0xD8);              /* a0-7 b0-7 */
            __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
            _mm_storeu_si128((__m128i *)(o + j), p8);
        }
#endif
        for (; j < d; j++) {
            float y = nearbyintf((float)v[j] / s);
            y = y > 127.f ? 127.f : (y < -127.f ? -127.f : y);
            o[j] = (int8_t)y;
        }
}

void int8_encode(const _Float16 *x, int64_t rows, int64_t d, _Float16 *scales, int8_t *q) {
    int64_t r = 0;
#ifdef VEC
    if (d % 8 == 0) /* 8 rows at a time: their scales in one division and one fp16 store */
        for (; r + 8 <= rows; r += 8) {
            const _Float16 *v = x + r * d;
            float s8[8];
            _mm256_storeu_ps(s8, rows8_scale(v, d, 127.f, scales + r));
            for (int i = 0; i < 8; i++) int8_row(v + i * d, d, s8[i], q + (r + i) * d);
        }
#endif
    for (; r < rows; r++) {
        const _Float16 *v = x + r * d;
        int8_row(v, d, row_scale(v, d, 127.0f, scales + r), q + r * d);
    }
}

void int8_decode(const int8_t *q, const _Float16 *scales, int64_t rows, int64_t d, _Float16 *x) {
    for (int64_t r = 0; r < rows; r++) {
        float s = (float)scales[r];
        const int8_t *iq = q + r * d;
        _Float16 *o = x + r * d;
        int64_t j = 0;
#ifdef VEC
        const __m256 vs = _mm256_set1_ps(s);
        for (; j + 8 <= d; j += 8) {
            __m256i i32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(iq + j)));
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(i32), vs);
            _mm_storeu_si128((__m128i *)(o + j), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; j < d; j++) o[j] = (_Float16)((float)iq[j] * s);
    }
}

/* ---- int4, KIVI style --------------------------------------------------------------
   A block x[L][2][T][H][D]. Keys are quantized per channel: for each (l, h, d), groups of
   gk tokens (gk * Gk >= T; past T the last token repeats); values per token: for each
   (l, t, h), groups of gv channels (past D the last channel repeats). Per group, in fp32:
   lo = min (+0 for either zero), s = max((max - lo) / 15, 1e-8), q = round half to even of (x - lo) / s,
   clamped to [0, 15]; s and lo are stored as fp16. The q of a part are numbered in the
   order [l][h][d][group][gk] (keys) and [l][t][h][group][gv] (values); q number f goes
   into byte f / 2, the low nibble when f is even. Exactly what codecs.py's torch path
   computes and lays out. */

/* fp16 <-> fp32 rows (F16C where compiled for; the loops below then vectorise on floats) */
static inline void load_row(const _Float16 *src, float *dst, int64_t n) {
    int64_t j = 0;
#ifdef VEC
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + j))));
#endif
    for (; j < n; j++) dst[j] = (float)src[j];
}

static inline void store_row(const float *src, _Float16 *dst, int64_t n) {
    int64_t j = 0;
#ifdef VEC
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) dst[j] = (_Float16)src[j];
}

/* q[j] = clamp(round half even((v[j] - lo[j]) / s[j]), 0, 15) */
static inline void quant4(const float *restrict v, const float *restrict lo, const float *restrict s, uint8_t *restrict q,
                          int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        float y = nearbyintf((v[j] - lo[j]) / s[j]);
        y = y < 0.f ? 0.f : y;
        y = y > 15.f ? 15.f : y;
        q[j] = (uint8_t)(int32_t)y;
    }
}

/* the same with one lo and s for the whole row */
static inline void quant4_row(const float *restrict v, float lo, float s, uint8_t *restrict q, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        float y = nearbyintf((v[j] - lo) / s);
        y = y < 0.f ? 0.f : y;
        y = y > 15.f ? 15.f : y;
        q[j] = (uint8_t)(int32_t)y;
    }
}

/* min and max of v[0:n), n >= 1; the max is NaN when a v[j] is */
static inline void minmax(const float *v, int64_t n, float *lo_out, float *hi_out) {
    float lo = v[0], hi = v[0];
    int64_t j = 0;
    int nan = v[0] != v[0];
#ifdef VEC
    if (n >= 8) {
        __m256 a = _mm256_loadu_ps(v), b = a, un = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
        for (j = 8; j + 8 <= n; j += 8) {
            __m256 c = _mm256_loadu_ps(v + j);
            a = _mm256_min_ps(a, c);
            b = _mm256_max_ps(b, c);
            un = _mm256_or_ps(un, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
        }
        nan |= _mm256_movemask_ps(un) != 0;
        float la[8], hb[8];
        _mm256_storeu_ps(la, a);
        _mm256_storeu_ps(hb, b);
        lo = la[0], hi = hb[0];
        for (int k = 1; k < 8; k++) {
            lo = la[k] < lo ? la[k] : lo;
            hi = hb[k] > hi ? hb[k] : hi;
        }
    }
#endif
    for (; j < n; j++) {
        lo = v[j] < lo ? v[j] : lo;
        hi = v[j] > hi ? v[j] : hi;
        nan |= v[j] != v[j];
    }
    *lo_out = lo;
    *hi_out = nan ? NAN : hi;
}

/* fp16 number i of a payload section that may start at an odd address */
static inline float ld16(const uint8_t *p, int64_t i) {
    _Float16 h;
    memcpy(&h, p + 2 * i, 2);
    return (float)h;
}

static inline void st16(uint8_t *p, int64_t i, float v) {
    _Float16 h = (_Float16)v;
    memcpy(p + 2 * i, &h, 2);
}

static inline void put4(uint8_t *packed, int64_t f, uint8_t q) { packed[f >> 1] |= (uint8_t)(q << ((f & 1) << 2)); }

static inline uint8_t get4(const uint8_t *packed, int64_t f) { return (packed[f >> 1] >> ((f & 1) << 2)) & 15; }

#ifdef VEC
/* a 16 x 16 byte matrix in 16 registers, transposed in place: four rounds of interleaving
   (bytes, then 2, 4 and 8 byte units), each pairing neighbouring rows */
static inline void transpose16x16(__m128i *x) {
    __m128i a[8][2], b[4][4], c[2][8];
    for (int p = 0; p < 8; p++) { /* a[p][h]: columns 8h..8h+7, rows 2p, 2p+1 */
        a[p][0] = _mm_unpacklo_epi8(x[2 * p], x[2 * p + 1]);
        a[p][1] = _mm_unpackhi_epi8(x[2 * p], x[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) /* b[q][g]: columns 4g..4g+3, rows 4q..4q+3 */
        for (int h = 0; h < 2; h++) {
            b[q][2 * h] = _mm_unpacklo_epi16(a[2 * q][h], a[2 * q + 1][h]);
            b[q][2 * h + 1] = _mm_unpackhi_epi16(a[2 * q][h], a[2 * q + 1][h]);
        }
    for (int s = 0; s < 2; s++) /* c[s][m]: columns 2m, 2m+1, rows 8s..8s+7 */
        for (int g = 0; g < 4; g++) {
            c[s][2 * g] = _mm_unpacklo_epi32(b[2 * s][g], b[2 * s + 1][g]);
            c[s][2 * g + 1] = _mm_unpackhi_epi32(b[2 * s][g], b[2 * s + 1][g]);
        }
    for (int m = 0; m < 8; m++) { /* column 2m and 2m + 1, all 16 rows */
        x[2 * m] = _mm_unpacklo_epi64(c[0][m], c[1][m]);
        x[2 * m + 1] = _mm_unpackhi_epi64(c[0][m], c[1][m]);
    }
}
#endif

/* dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols */
static void transpose_bytes(const uint8_t *src, int64_t src_stride, int64_t rows, int64_t cols, uint8_t *dst,
                            int64_t dst_stride) {
    int64_t r0 = 0;
#ifdef VEC
    for (; r0 + 16 <= rows; r0 += 16) {
        int64_t c0 = 0;
        for (; c0 + 16 <= cols; c0 += 16) {
            __m128i x[16];
            for (int i = 0; i < 16; i++) x[i] = _mm_loadu_si128((const __m128i *)(src + (r0 + i) * src_stride + c0));
            transpose16x16(x);
            for (int i = 0; i < 16; i++) _mm_storeu_si128((__m128i *)(dst + (c0 + i) * dst_stride + r0), x[i]);
        }
        for (; c0 < cols; c0++)
            for (int64_t i = 0; i < 16; i++) dst[c0 * dst_stride + r0 + i] = src[(r0 + i) * src_stride + c0];
    }
#endif
    for (; r0 < rows; r0++)
        for (int64_t c = 0; c < cols; c++) dst[c * dst_stride + r0] = src[r0 * src_stride + c];
}

#define MAXW 1024 /* widest head_dim the stack buffers take (groups are at most 128) */
#define CACHE 8192 /* floats of one key group kept converted (16 tokens x 512 channels) */

/* Returns 0, or -1 when D or a group is wider than MAXW (the caller uses torch). */
int int4_encode(const _Float16 *x, int64_t L, int64_t T, int64_t H, int64_t D, int64_t gk, int64_t Gk, int64_t gv,
                int64_t Gv, uint8_t *k_scale, uint8_t *k_lo, uint8_t *k_packed, uint8_t *v_scale, uint8_t *v_lo,
                uint8_t *v_packed) {
    if (D > MAXW || gv > MAXW) return -1;
    float mn[MAXW], mx[MAXW], sc[MAXW], r0[MAXW], r1[MAXW], group[CACHE];
    uint8_t pairs[CACHE / 2]; /* [token pair][channel] bytes of a cached key group */
    uint8_t qa[MAXW], qb[MAXW];
    memset(k_packed, 0, (size_t)((L * H * D * Gk * gk + 1) / 2));
    memset(v_packed, 0, (size_t)((L * T * H * Gv * gv + 1) / 2));
    for (int64_t l = 0; l < L; l++) {
        const _Float16 *keys = x + (l * 2) * T * H * D, *vals = x + (l * 2 + 1) * T * H * D;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t gi = 0; gi < Gk; gi++) {
                for (int64_t d = 0; d < D; d++) { mn[d] = INFINITY; mx[d] = -INFINITY; }
                int cached = gk * D <= CACHE; /* the group's rows converted once, kept for quantizing */
                for (int64_t tt = 0; tt < gk; tt++) {
                    int64_t t = gi * gk + tt < T ? gi * gk + tt : T - 1;
                    float *row = cached ? group + tt * D : r0;
                    load_row(keys + (t * H + h) * D, row, D);
                    for (int64_t d = 0; d < D; d++) {
                        mn[d] = row[d] < mn[d] ? row[d] : mn[d];
                        mx[d] = row[d] > mx[d] || row[d] != row[d] ? row[d] : mx[d]; /* a NaN stays */
                    }
                }
                for (int64_t d = 0; d < D; d++) {
                    mn[d] = mn[d] + 0.0f; /* -0 -> +0: which zero a min keeps depends on the order */
                    float s = (mx[d] - mn[d]) / 15.0f;
                    sc[d] = s < 1e-8f ? 1e-8f : s;
                }
                for (int64_t d = 0; d < D; d++) {
                    int64_t g = ((l * H + h) * D + d) * Gk + gi;
                    st16(k_scale, g, sc[d]);
                    st16(k_lo, g, mn[d]);
                }
                int64_t stride = Gk * gk;                            /* between channels */
                int64_t base = ((l * H + h) * D) * Gk * gk + gi * gk; /* channel 0, token 0 */
                for (int64_t tt = 0; tt < gk; tt += 2) {
                    const float *k0 = group + tt * D, *k1 = group + (tt + 1) * D;
                    if (!cached) {
                        int64_t t0 = gi * gk + tt < T ? gi * gk + tt : T - 1;
                        int64_t t1 = gi * gk + tt + 1 < T ? gi * gk + tt + 1 : T - 1;
                        load_row(keys + (t0 * H + h) * D, r0, D);
                        if (tt + 1 < gk) load_row(keys + (t1 * H + h) * D, r1, D);
                        k0 = r0, k1 = r1;
                    }
                    quant4(k0, mn, sc, qa, D);
                    if (tt + 1 < gk) quant4(k1, mn, sc, qb, D);
                    if (gk % 2 == 0 && cached) { /* the pair shares a byte: a row of the pair matrix */
                        uint8_t *row = pairs + (tt >> 1) * D;
                        for (int64_t d = 0; d < D; d++) row[d] = (uint8_t)(qa[d] | (qb[d] << 4));
                    } else if (gk % 2 == 0) {
                        uint8_t *o = k_packed + ((base + tt) >> 1);
                        int64_t bstride = stride >> 1;
                        for (int64_t d = 0; d < D; d++) o[d * bstride] = (uint8_t)(qa[d] | (qb[d] << 4));
                    } else {
                        for (int64_t d = 0; d < D; d++) {
                            put4(k_packed, base + d * stride + tt, qa[d]);
                            if (tt + 1 < gk) put4(k_packed, base + d * stride + tt + 1, qb[d]);
                        }
                    }
                }
                /* channel d's bytes are contiguous in the payload: the pair matrix transposed */
                if (gk % 2 == 0 && cached) transpose_bytes(pairs, D, gk >> 1, D, k_packed + (base >> 1), stride >> 1);
            }
        }
        for (int64_t t = 0; t < T; t++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t r = (l * T + t) * H + h;
                load_row(vals + (t * H + h) * D, r0, D);
                for (int64_t gi = 0; gi < Gv; gi++) {
                    const float *v = r0 + gi * gv;
                    int64_t n = gi * gv + gv <= D ? gv : D - gi * gv; /* past D the last channel repeats */
                    float lo, hi;
                    minmax(v, n, &lo, &hi);
                    lo = lo + 0.0f;
                    float s = (hi - lo) / 15.0f;
                    s = s < 1e-8f ? 1e-8f : s;
                    st16(v_scale, r * Gv + gi, s);
                    st16(v_lo, r * Gv + gi, lo);
                    quant4_row(v, lo, s, qa, n);
                    for (int64_t j = n; j < gv; j++) qa[j] = qa[n - 1];
                    int64_t f = (r * Gv + gi) * gv;
                    if (f % 2 == 0 && gv % 2 == 0) {
                        uint8_t *o = v_packed + (f >> 1);
                        for (int64_t j = 0; j < gv / 2; j++) o[j] = (uint8_t)(qa[2 * j] | (qa[2 * j + 1] << 4));
                    } else {
                        for (int64_t j = 0; j < gv; j++) put4(v_packed, f + j, qa[j]);
                    }
                }
            }
        }
    }
    return 0;
}

int int4_decode(const uint8_t *k_scale, const uint8_t *k_lo, const uint8_t *k_packed, const uint8_t *v_scale,
                const uint8_t *v_lo, const uint8_t *v_packed, int64_t L, int64_t T, int64_t H, int64_t D, int64_t gk,
                int64_t Gk, int64_t gv, int64_t Gv, _Float16 *x) {
    if (D > MAXW || gv > MAXW) return -1;
    float sc[MAXW], lo[MAXW], row[MAXW];
    uint8_t qa[MAXW], pairs[CACHE / 2];
    for (int64_t l = 0; l < L; l++) {
        _Float16 *keys = x + (l * 2) * T * H * D, *vals = x + (l * 2 + 1) * T * H * D;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t gi = 0; gi < Gk; gi++) {
                for (int64_t d = 0; d < D; d++) {
                    int64_t g = ((l * H + h) * D + d) * Gk + gi;
                    sc[d] = ld16(k_scale, g);
                    lo[d] = ld16(k_lo, g);
                }
                int64_t stride = Gk * gk, base = ((l * H + h) * D) * Gk * gk + gi * gk;
                /* gk even: the group's pair bytes, [channel][pair] in the payload, as [pair][channel] */
                int tiled = gk % 2 == 0 && gk * D <= CACHE;
                if (tiled) transpose_bytes(k_packed + (base >> 1), stride >> 1, D, gk >> 1, pairs, D);
                for (int64_t tt = 0; tt < gk && gi * gk + tt < T; tt++) {
                    int64_t f = base + tt;
                    const uint8_t *b = k_packed + (f >> 1);
                    if (tiled) {
                        const uint8_t *p = pairs + (tt >> 1) * D;
                        int shift = (int)((tt & 1) << 2);
                        for (int64_t d = 0; d < D; d++) qa[d] = (p[d] >> shift) & 15;
                    } else if (stride % 2 == 0) { /* the same nibble of every channel */
                        int shift = (int)((f & 1) << 2);
                        int64_t bstride = stride >> 1;
                        for (int64_t d = 0; d < D; d++) qa[d] = (b[d * bstride] >> shift) & 15;
                    } else {
                        for (int64_t d = 0; d < D; d++) qa[d] = get4(k_packed, f + d * stride);
                    }
                    for (int64_t d = 0; d < D; d++) {
                        float y = (float)qa[d] * sc[d];
                        row[d] = y + lo[d];
                    }
                    store_row(row, keys + ((gi * gk + tt) * H + h) * D, D);
                }
            }
        }
        for (int64_t t = 0; t < T; t++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t r = (l * T + t) * H + h;
                for (int64_t gi = 0; gi < Gv; gi++) {
                    int64_t g = r * Gv + gi, f = g * gv, n = gi * gv + gv <= D ? gv : D - gi * gv;
                    if (f % 2 == 0) {
                        const uint8_t *b = v_packed + (f >> 1);
                        for (int64_t j = 0; j < (n + 1) / 2; j++) {
                            qa[2 * j] = b[j] & 15;
                            qa[2 * j + 1] = b[j] >> 4;
                        }
                    } else {
                        for (int64_t j = 0; j < n; j++) qa[j] = get4(v_packed, f + j);
                    }
                    float s = ld16(v_scale, g), m = ld16(v_lo, g);
                    for (int64_t j = 0; j < n; j++) {
                        float y = (float)qa[j] * s;
                        row[gi * gv + j] = y + m;
                    }
                }
                store_row(row, vals + (t * H + h) * D, D);
            }
        }
    }
    return 0;
}

/* ---- fp8 (float8_e4m3fn) ------------------------------------------------------------
   Per row of d values, as codecs.py's torch path: scale = max(absmax, 1e-8) / 448 in
   fp32 (stored as fp16), q = fp8(x / scale) with torch's own conversion (c10's
   fp8e4m3fn_from_fp32_value: round to nearest even, saturating at 448, NaN to NaN). Decode:
   the e4m3 value (a 256-entry table) * the fp16 scale in fp32, rounded to fp16. */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint8_t to_e4m3(float f) {
    uint32_t bits = f32_bits(f), sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t r;
    if (bits >= (1087u << 20)) {
        r = bits > 0x7F800000u ? 0x7F : 0x7E; /* NaN stays NaN; past 464 and infinity saturate */
    } else if (bits < (121u << 23)) { /* below 2^-6: a subnormal, rounded by the FPU */
        const uint32_t denorm = 141u << 23;
        r = (uint8_t)(f32_bits(f32_from(bits) + f32_from(denorm)) - denorm);
    } else {
        uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
        bits += odd;
        r = (uint8_t)(bits >> 20);
        r = r == 0x7F ? 0x7E : r; /* rounding up into the NaN pattern saturates */
    }
    return r | (uint8_t)(sign >> 24);
}

#ifdef VEC
/* to_e4m3 of 8 floats (both roundings computed, the right one kept), as 8 bytes */
static inline uint64_t to_e4m3_x8(__m256 f) {
    __m256i b = _mm256_castps_si256(f);
    __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32((int)0x80000000u));
    __m256i a = _mm256_xor_si256(b, sign);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    __m256i rn = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF))), odd);
    rn = _mm256_srli_epi32(rn, 20);
    rn = _mm256_sub_epi32(rn, _mm256_and_si256(_mm256_cmpeq_epi32(rn, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(1)));
    __m256 fs = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32(141 << 23)));
    __m256i rs = _mm256_sub_epi32(_mm256_castps_si256(fs), _mm256_set1_epi32(141 << 23));
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
    __m256i over = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((int)((1087u << 20) - 1)));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    __m256i r = _mm256_blendv_epi8(rn, rs, sub);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7E), over);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
    r = _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0xFF)), _mm256_srli_epi32(sign, 24));
    __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    return (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(p16, p16));
}
#endif

#if defined(VEC) && defined(__AVX512F__) && defined(__AVX512BW__)
#define VEC512 1
/* to_e4m3_x8's arithmetic on 16 floats, the roundings chosen by masks */
static inline __m128i to_e4m3_x16(__m512 f) {
    __m512i b = _mm512_castps_si512(f);
    __m512i sign = _mm512_and_si512(b, _mm512_set1_epi32((int)0x80000000u));
    __m512i a = _mm512_xor_si512(b, sign);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    __m512i rn = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF))), odd);
    rn = _mm512_srli_epi32(rn, 20);
    rn = _mm512_mask_sub_epi32(rn, _mm512_cmpeq_epi32_mask(rn, _mm512_set1_epi32(0x7F)), rn, _mm512_set1_epi32(1));
    __m512 fs = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_set1_epi32(141 << 23)));
    __m512i rs = _mm512_sub_epi32(_mm512_castps_si512(fs), _mm512_set1_epi32(141 << 23));
    __m512i r = _mm512_mask_mov_epi32(rn, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(121 << 23)), rs);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32((int)((1087u << 20) - 1))),
                              _mm512_set1_epi32(0x7E));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
    r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xFF)), _mm512_srli_epi32(sign, 24));
    return _mm512_cvtepi32_epi8(r);
}
#endif

static float e4m3_table[256];
/* filled when the library loads, before any thread can decode */
__attribute__((constructor)) static void e4m3_init(void) {
    for (int b = 0; b < 256; b++) {
        int sign = b & 0x80, e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7) v = f32_from(0x7FF00000u); /* the NaN c10 makes of it */
        else if (e == 0) v = ldexpf((float)m, -9); /* subnormal: m / 8 * 2^-6 */
        else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
        e4m3_table[b] = sign ? -v : v;
    }
}

/* e4m3 bytes of one row of fp16 values divided by its fp32 scale s */
static inline void fp8_row(const _Float16 *v, int64_t d, float s, uint8_t *o) {
    int64_t j = 0;
#ifdef VEC512
    const __m512 vs16 = _mm512_set1_ps(s);
    for (; j + 16 <= d; j += 16)
        _mm_storeu_si128((__m128i *)(o + j),
                         to_e4m3_x16(_mm512_div_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + j))), vs16)));
#endif
#ifdef VEC
    const __m256 vs = _mm256_set1_ps(s);
    for (; j + 8 <= d; j += 8) {
        uint64_t q8 = to_e4m3_x8(_mm256_div_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j))), vs));
        memcpy(o + j, &q8, 8);
    }
#endif
    for (; j < d; j++) o[j] = to_e4m3((float)v[j] / s);
}

void fp8_encode(const _Float16 *x, int64_t rows, int64_t d, _Float16 *scales, uint8_t *q) {
    int64_t r = 0;
#ifdef VEC
    if (d % 8 == 0)
        for (; r + 8 <= rows; r += 8) {
            float s8[8];
            _mm256_storeu_ps(s8, rows8_scale(x + r * d, d, 448.f, scales + r));
            for (int i = 0; i < 8; i++) fp8_row(x + (r + i) * d, d, s8[i], q + (r + i) * d);
        }
#endif
    for (; r < rows; r++) fp8_row(x + r * d, d, row_scale(x + r * d, d, 448.0f, scales + r), q + r * d);
}

#ifdef VEC
/* e4m3_table of 8 bytes (one per 32-bit lane), from their bits: a normal's exponent
   rebiased, a subnormal m * 2^-9 (exact in fp32), 0x7F / 0xFF the NaN c10 makes */
static inline __m256 e4m3_x8(__m256i b) {
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256i e = _mm256_and_si256(_mm256_srli_epi32(b, 3), _mm256_set1_epi32(15));
    __m256i m = _mm256_and_si256(b, _mm256_set1_epi32(7));
    __m256i normal = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
                                     _mm256_slli_epi32(m, 20));
    __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.f / 512.f)));
    __m256i v = _mm256_blendv_epi8(normal, sub, _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(0x7F));
    v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7FF00000), nan);
    return _mm256_castsi256_ps(_mm256_or_si256(v, sign));
}
#endif

void fp8_decode(const uint8_t *q, const _Float16 *scales, int64_t rows, int64_t d, _Float16 *x) {
    float v[MAXW];
    for (int64_t r = 0; r < rows; r++) {
        float s = (float)scales[r];
        const uint8_t *iq = q + r * d;
        int64_t j = 0;
#ifdef VEC
        const __m256 vs = _mm256_set1_ps(s);
        for (; j + 8 <= d; j += 8) {
            uint64_t q8;
            memcpy(&q8, iq + j, 8);
            __m256 f = _mm256_mul_ps(e4m3_x8(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)q8))), vs);
            _mm_storeu_si128((__m128i *)(x + r * d + j), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (int64_t j0 = j; j0 < d; j0 += MAXW) {
            int64_t n = d - j0 < MAXW ? d - j0 : MAXW;
            for (int64_t k = 0; k < n; k++) v[k] = e4m3_table[iq[j0 + k]] * s;
            store_row(v, x + r * d + j0, n);
        }
    }
}
