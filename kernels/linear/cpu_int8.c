/* Int8 products for the CPU's decode-sized batches: y = x @ W^T with W int8 (per-row scales)
 * and x quantized to int8 on the fly, per row and per group of GROUP columns (dynamic,
 * symmetric, as llama.cpp's Q8_0 activations), multiplied with AVX512-VNNI.
 *
 *     x[m, k] ~= xs[m, g] * xq[m, k]          (k in group g; xq = rne(x * 127 / amax_g))
 *     W[n, k] ~= ws[n] * wq[n, k]             (wq in [-127, 127])
 *     y[m, n]  = ws[n] * sum_g xs[m, g] * sum_{k in g} xq[m, k] * wq[n, k]
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are stored offset by 128
 * (wu = wq + 128, in 1..255) and the activations signed: the integer sum of a group is then
 * sum xq * wu - 128 * sum xq, and the second term depends only on the row and the group. It
 * is folded into one float per row (corr[m] = sum_g xs[m, g] * 128 * sum_{k in g} xq[m, k]),
 * so the inner loop is vpdpbusd and, once per group, one convert and one fma.
 *
 * Weights are packed (by kernels/linear/cpu_int8.py) as [N/64][K/4][4][16][4] bytes: one
 * 64-byte load is 4 consecutive columns of 16 output rows (the lanes vpdpbusd sums), and a
 * block of 64 output rows streams as one sequential run of 256-byte column quads. Every
 * integer sum is exact (|xq * wu| <= 127 * 255, summed over a group of at most 256 columns),
 * so the result differs from the reference math only in the float sums' order.
 *
 * x and y are fp32 or bf16 (widened / rounded to nearest even). Threads (OpenMP, torch's
 * libgomp) split the output rows; rows are taken 3 at a time against a block held in L1/L2.
 * Without AVX512-VNNI the same math runs in plain C.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_ROWS (1 << 24)
#define MAX_K 16384

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                              /* RNE */
    return (uint16_t)(u >> 16);
}

/* Row m of x: its int8 values (k padded with zeros to a multiple of 4), per-group scales and
 * the row's correction term. A group's values are round-to-nearest-even(x * (127 / amax)),
 * its scale amax / 127; a zero group gets scale 0 and zeros. */
static void quantize_row_scalar(const void *x, int x_bf16, int64_t offset, int k, int group,
                                int8_t *xq, float *xs, float *corr) {
    double c = 0.0;
    int ng = (k + group - 1) / group;
    for (int g = 0; g < ng; g++) {
        int k0 = g * group, kn = k - k0 < group ? k - k0 : group;
        float amax = 0.f;
        for (int i = 0; i < kn; i++) {
            float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[offset + k0 + i])
                             : ((const float *)x)[offset + k0 + i];
            float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < kn; i++) {
            float v = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[offset + k0 + i])
                             : ((const float *)x)[offset + k0 + i];
            int q = (int)lrintf(v * inv);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            xq[k0 + i] = (int8_t)q;
            sum += q;
        }
        xs[g] = amax / 127.f;
        c += (double)(amax / 127.f) * 128.0 * (double)sum;
    }
    for (int i = k; i < ((k + 3) & ~3); i++) xq[i] = 0;
    *corr = (float)c;
}

#ifdef __AVX512F__
/* 16 values from x at index i (bf16 or fp32), lanes past n zero. */
static inline __m512 load16(const void *x, int x_bf16, int64_t i, int n) {
    __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (x_bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
}

/* quantize_row_scalar's math, 16 lanes at a time (groups a multiple of 16 columns). */
static void quantize_row(const void *x, int x_bf16, int64_t offset, int k, int group,
                         int8_t *xq, float *xs, float *corr) {
    if (group % 16 || group > 256) {
        quantize_row_scalar(x, x_bf16, offset, k, group, xq, xs, corr);
        return;
    }
    double c = 0.0;
    int ng = (k + group - 1) / group;
    const __m512 sign = _mm512_set1_ps(-0.f);
    __m512 v[16];
    for (int g = 0; g < ng; g++) {
        int k0 = g * group, kn = k - k0 < group ? k - k0 : group, nv = (kn + 15) / 16;
        __m512 amax = _mm512_setzero_ps();
        for (int j = 0; j < nv; j++) {
            v[j] = load16(x, x_bf16, offset + k0 + j * 16, kn - j * 16);
            amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[j]));
        }
        float a = _mm512_reduce_max_ps(amax);
        __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < nv; j++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], inv));      /* nearest even */
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                 _mm512_set1_epi32(-127));
            sum = _mm512_add_epi32(sum, q);
            int n = kn - j * 16;
            __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
            _mm512_mask_cvtepi32_storeu_epi8(xq + k0 + j * 16, mask, q);
        }
        xs[g] = a / 127.f;
        c += (double)(a / 127.f) * 128.0 * (double)_mm512_reduce_add_epi32(sum);
    }
    for (int i = k; i < ((k + 3) & ~3); i++) xq[i] = 0;
    *corr = (float)c;
}
#else
#define quantize_row quantize_row_scalar
#endif

#define BLOCK 4           /* 16-row tiles per packed block: 64 outputs, 256 bytes per column quad */
#define MT_MAX 3          /* rows per register pass */
#define PREFETCH 16       /* column quads ahead */

/* Output lanes [n0, n0 + 16) of row y_row from v (fp32), masked past n_out. */
#ifdef __AVX512VNNI__
static inline void store16(void *y, int y_bf16, int64_t index, int valid, __m512 v) {
    __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    if (y_bf16) {
#ifdef __AVX512BF16__
        __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else
        __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
        _mm256_mask_storeu_epi16((uint16_t *)y + index, mask, h);
    } else {
        _mm512_mask_storeu_ps((float *)y + index, mask, v);
    }
}

/* MT rows x NT tiles of 16 outputs over all of K, in registers (compile-time sizes, so the
 * loops unroll). w: the first tile's bytes of column quad 0 (quads 256 bytes apart). */
static inline __attribute__((always_inline)) void tile(
        const uint8_t *w, const int8_t *xq, int64_t xq_stride, const float *xs,
        int64_t xs_stride, const float *corr, const float *ws, int k4, int group, void *y,
        int y_bf16, int64_t y_stride, int n0, int n_out, const int MT, const int NT) {
    /* fixed sizes (not MT x NT, which would make them variable-length arrays in memory): the
     * loops unroll and every element stays in a register */
    __m512 acc[MT_MAX][BLOCK];
    __m512i dot[MT_MAX][BLOCK];
    for (int m = 0; m < MT; m++)
        for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
    int g4 = group / 4;
    for (int q0 = 0, g = 0; q0 < k4; q0 += g4, g++) {
        int q1 = q0 + g4 < k4 ? q0 + g4 : k4;
        for (int m = 0; m < MT; m++)
            for (int t = 0; t < NT; t++) dot[m][t] = _mm512_setzero_si512();
        for (int q = q0; q < q1; q++) {
            __m512i wv[BLOCK];
            const uint8_t *wq = w + (int64_t)q * (BLOCK * 64);
            for (int line = 0; line < NT; line++)
                _mm_prefetch((const char *)(wq + PREFETCH * BLOCK * 64 + line * 64), _MM_HINT_T0);
            for (int t = 0; t < NT; t++) wv[t] = _mm512_loadu_si512((const void *)(wq + t * 64));
            for (int m = 0; m < MT; m++) {
                int32_t four;
                memcpy(&four, xq + m * xq_stride + q * 4, 4);
                __m512i xv = _mm512_set1_epi32(four);
                for (int t = 0; t < NT; t++) dot[m][t] = _mm512_dpbusd_epi32(dot[m][t], wv[t], xv);
            }
        }
        for (int m = 0; m < MT; m++) {
            __m512 s = _mm512_set1_ps(xs[m * xs_stride + g]);
            for (int t = 0; t < NT; t++)
                acc[m][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][t]), s, acc[m][t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        int n = n0 + t * 16;
        if (n >= n_out) break;
        __m512 sw = _mm512_loadu_ps(ws + t * 16);
        for (int m = 0; m < MT; m++) {
            __m512 v = _mm512_mul_ps(_mm512_sub_ps(acc[m][t], _mm512_set1_ps(corr[m])), sw);
            store16(y, y_bf16, m * y_stride + n, n_out - n, v);
        }
    }
}

#define TILE(MT, NT) tile(w, xq, xq_stride, xs, xs_stride, corr, ws, k4, group, y, y_bf16, \
                          y_stride, n0, n_out, MT, NT)
#endif

static inline void store1(void *y, int y_bf16, int64_t index, float v) {
    if (y_bf16) ((uint16_t *)y)[index] = f32_to_bf16(v);
    else ((float *)y)[index] = v;
}

/* Rows [0, mt) (mt <= MT_MAX) against nt tiles starting at output n0; w, ws, xq, xs, corr
 * and y already offset to them. */
static void tiles(int mt, int nt, const uint8_t *w, const int8_t *xq, int64_t xq_stride,
                  const float *xs, int64_t xs_stride, const float *corr, const float *ws,
                  int k4, int group, void *y, int y_bf16, int64_t y_stride, int n0, int n_out) {
#ifdef __AVX512VNNI__
    if (nt == 4) {
        switch (mt) {
            case 1: TILE(1, 4); return;
            case 2: TILE(2, 4); return;
            case 3: TILE(3, 4); return;
        }
    } else {
        switch (mt) {
            case 1: TILE(1, 2); return;
            case 2: TILE(2, 2); return;
            case 3: TILE(3, 2); return;
        }
    }
#else
    for (int m = 0; m < mt; m++)
        for (int lane = 0; lane < nt * 16 && n0 + lane < n_out; lane++) {
            int t = lane / 16, r = lane % 16;
            float acc = 0.f;
            for (int q0 = 0, g = 0; q0 < k4; q0 += group / 4, g++) {
                int32_t dot = 0;
                int q1 = q0 + group / 4 < k4 ? q0 + group / 4 : k4;
                for (int q = q0; q < q1; q++)
                    for (int j = 0; j < 4; j++)
                        dot += (int32_t)w[(int64_t)q * (BLOCK * 64) + t * 64 + r * 4 + j]
                               * (int32_t)xq[m * xq_stride + q * 4 + j];
                acc = fmaf((float)dot, xs[m * xs_stride + g], acc);
            }
            store1(y, y_bf16, m * y_stride + n0 + lane, (acc - corr[m]) * ws[lane]);
        }
#endif
}

/* y[m, n] for m < rows, n < n_out. wp: packed weights, ceil(n_out/64) blocks of
 * ceil(k/4) column quads of [4 tiles][16 rows][4 columns] bytes; ws: blocks*64 scales; x:
 * [rows, k] with row stride x_stride (elements); y: [rows, n_out] contiguous. group: a
 * multiple of 4, at most 256 (the last group may be short). Scratch: xq rows*ceil(k/4)*4
 * bytes, xs rows*ceil(k/group) and corr rows floats. Returns 0, or -1 for sizes it does not
 * take. */
int int8_linear(const void *x, int x_bf16, int64_t x_stride, int rows, int k, const uint8_t *wp,
                const float *ws, int n_out, int group, void *y, int y_bf16, int threads,
                int8_t *xq, float *xs, float *corr) {
    if (rows <= 0 || rows > MAX_ROWS || k <= 0 || k > MAX_K || group < 4 || group % 4
            || group > 256 || n_out <= 0)
        return -1;
    int k4 = (k + 3) / 4, ng = (k + group - 1) / group;
    int nblocks = (n_out + BLOCK * 16 - 1) / (BLOCK * 16);
    int64_t block_bytes = (int64_t)k4 * BLOCK * 64, xq_stride = (int64_t)k4 * 4;
    if (threads < 1) threads = 1;
    /* Each thread takes one contiguous run of half blocks (whole blocks where both halves are
     * its own), so its weights stream as one sequential run; only a block split between two
     * threads is read by halves. */
    int units = nblocks * 2;
    if (threads > units) threads = units;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < rows; m++)
            quantize_row(x, x_bf16, (int64_t)m * x_stride, k, group, xq + m * xq_stride,
                         xs + (int64_t)m * ng, corr + m);
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int u = (int)((int64_t)units * tid / nth), u1 = (int)((int64_t)units * (tid + 1) / nth);
        while (u < u1) {
            int b = u / 2, whole = u % 2 == 0 && u + 1 < u1;
            int nt = whole ? BLOCK : BLOCK / 2, t0 = whole ? 0 : (u % 2) * (BLOCK / 2);
            int n0 = b * BLOCK * 16 + t0 * 16;
            u += whole ? 2 : 1;
            if (n0 >= n_out) continue;
            const uint8_t *w = wp + b * block_bytes + t0 * 64;
            for (int m0 = 0; m0 < rows; m0 += MT_MAX) {
                int mr = rows - m0 < MT_MAX ? rows - m0 : MT_MAX;
                tiles(mr, nt, w, xq + m0 * xq_stride, xq_stride, xs + (int64_t)m0 * ng, ng,
                      corr + m0, ws + n0, k4, group,
                      y_bf16 ? (void *)((uint16_t *)y + (int64_t)m0 * n_out)
                             : (void *)((float *)y + (int64_t)m0 * n_out),
                      y_bf16, n_out, n0, n_out);
            }
        }
    }
    return 0;
}
