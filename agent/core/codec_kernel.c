/* The int8 codec of agent/core/codecs.py for fp16 blocks, in C (AVX2 + F16C where the
   compiler targets them, plain C otherwise). Bit for bit what the torch path computes on
   finite blocks (a NaN or infinity, which no engine's KV holds, encodes differently):
   per row of head_dim values, scale = max(absmax, 1e-8) / 127 in fp32, q = round half to
   even of x / scale (a true division, as torch does), clamped to [-127, 127]; the scale
   is stored as fp16. Decode: q * fp16 scale in fp32, rounded to fp16. Built and loaded by
   protos.native. */

#include <stdint.h>
#include <math.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VEC 1
#endif

static inline float row_absmax(const _Float16 *v, int64_t d) {
    float m = 0.f;
    int64_t j = 0;
#ifdef VEC
    __m256 acc = _mm256_setzero_ps();
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (; j + 8 <= d; j += 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j)));
        acc = _mm256_max_ps(acc, _mm256_and_ps(a, nosign));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    m = _mm_cvtss_f32(h);
#endif
    for (; j < d; j++) { float a = fabsf((float)v[j]); m = a > m ? a : m; }
    return m;
}

void int8_encode(const _Float16 *x, int64_t rows, int64_t d, _Float16 *scales, int8_t *q) {
    for (int64_t r = 0; r < rows; r++) {
        const _Float16 *v = x + r * d;
        float m = row_absmax(v, d);
        float s = (m > 1e-8f ? m : 1e-8f) / 127.0f;
        scales[r] = (_Float16)s;
        int8_t *o = q + r * d;
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
