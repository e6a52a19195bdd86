/* Batched paged decode attention for the CPU: one call per layer for a whole decode batch.
 *
 * Each decode row (one query token per sequence, every query head) attends to the first
 * lens[b] positions of its sequence, read in place from the paged cache through its block
 * table. The work is split flash-decoding style into items (sequence, KV head, chunk of
 * CHUNK keys) spread over the threads; each item keeps the partial softmax of its G query
 * heads (max m, sum l, unnormalised accumulator), and a merge pass combines the chunks:
 *
 *     M = max_c m_c     L = sum_c l_c e^(m_c - M)     O = sum_c acc_c e^(m_c - M) / L
 *     lse = M + log L   (a row with no key: O = 0, lse = -inf)
 *
 * Caches are fp32 or bf16 (widened to fp32 on load), any layout whose head dim is
 * contiguous: key t of a row with block table T sits at T[t / bs] * sb + (t % bs) * so
 * + kvh * sh (elements). q, O and lse are fp32.
 * Built by kernels/attention/cpu_paged.py with the host compiler (-O3 -march=native) and
 * called through ctypes; OpenMP resolves to the libgomp torch has already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 32
#define MAX_D 256
#define MAX_CHUNK 512

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void load_row(const void *base, int64_t offset, int is_bf16, int d, float *out) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < d; i++) out[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(out, (const float *)base + offset, (size_t)d * sizeof(float));
    }
}

/* Ask for a cache row ahead of use: the rows of one item are scattered over blocks and, in
 * a decode step, cold (the layer's weight products came in between), so without this the
 * sweep waits on each row's memory latency in turn. */
#define AHEAD 8
static inline void prefetch_row(const void *base, int64_t offset, int is_bf16, int d) {
    int elem = is_bf16 ? 2 : 4;
    const char *p = (const char *)base + offset * elem;
    for (int b = 0; b < d * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* Pairwise partial sums, within 128-bit lanes: [a0+a2, b0+b2, a1+a3, b1+b3] per lane. */
static inline __m512 sum_ps_pairs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* Of two sum_ps_pairs results (a, b | c, d): each 128-bit lane's [a, b, c, d] partials. */
static inline __m512 sum_pd_pairs(__m512 x, __m512 y) {
    __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)),   /* 64-bit moves, */
                         _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));  /* float adds */
}

/* The 16 horizontal sums of v[0..15] as one vector, lane j = sum of v[j] (45 shuffles and
 * adds, against about 10 per vector reduced alone). */
static inline __m512 sum16(const __m512 *v) {
    __m512 x[4];
    for (int i = 0; i < 4; i++)
        x[i] = sum_pd_pairs(sum_ps_pairs(v[4 * i], v[4 * i + 1]),
                            sum_ps_pairs(v[4 * i + 2], v[4 * i + 3]));
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                               _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                               _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88),
                         _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

/* Scores of G query heads against up to 16 key rows kt[j][0..d) (fp32):
 * s[gi * n + j0 + j] = scale * q_gi . k_j for j < nk. */
static void score_tile(const float *qh, float kt[16][MAX_D], int nk, int d, int g,
                       float scale, float *s, int n, int j0) {
    for (int j = nk; j < 16; j++) memset(kt[j], 0, (size_t)d * sizeof(float));
    __mmask16 keys = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1u);
    for (int gi = 0; gi < g; gi++) {
        const float *qg = qh + gi * d;
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) {
            __mmask16 cols = d - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (d - i)) - 1u);
            __m512 qv = _mm512_maskz_loadu_ps(cols, qg + i);
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(cols, kt[j] + i), acc[j]);
        }
        __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + gi * n + j0, keys, sc);
    }
}
#else
static void score_tile(const float *qh, float kt[16][MAX_D], int nk, int d, int g,
                       float scale, float *s, int n, int j0) {
    for (int j = 0; j < nk; j++)
        for (int gi = 0; gi < g; gi++) {
            const float *qg = qh + gi * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < d; i++) dot += qg[i] * kt[j][i];
            s[gi * n + j0 + j] = dot * scale;
        }
}
#endif

/* One item: query heads [kvh*G, kvh*G+G) of sequence b against keys [t0, t1). */
static void sweep(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                  const int64_t *table, int t0, int t1, int d, int bs, int64_t sb,
                  int64_t so, int64_t sh, int kvh, int g, float scale, float *s, float *acc, float *m_out,
                  float *l_out) {
    float vf[MAX_D];
    const float *qh = q + (int64_t)kvh * g * d;
    int n = t1 - t0;
    /* cursors (block, offset) walk the keys without a division per key: `at` the key being
     * read, `ahead` the key AHEAD of it being prefetched */
    int at_b = t0 / bs, at_o = t0 % bs, ahead_b = at_b, ahead_o = at_o;
    int64_t head = (int64_t)kvh * sh;
    for (int j = 0; j < AHEAD && j < n; j++) {
        prefetch_row(k_cache, table[ahead_b] * sb + ahead_o * so + head, is_bf16, d);
        if (++ahead_o == bs) { ahead_o = 0; ahead_b++; }
    }
    float kt[16][MAX_D];
    for (int j0 = 0; j0 < n; j0 += 16) {        /* tiles of 16 keys: read, then scored */
        int nk = n - j0 < 16 ? n - j0 : 16;
        for (int j = j0; j < j0 + nk; j++) {
            int64_t row = table[at_b] * sb + at_o * so + head;
            if (++at_o == bs) { at_o = 0; at_b++; }
            if (j + AHEAD < n) {
                prefetch_row(k_cache, table[ahead_b] * sb + ahead_o * so + head, is_bf16, d);
                if (++ahead_o == bs) { ahead_o = 0; ahead_b++; }
            }
            prefetch_row(v_cache, row, is_bf16, d);      /* read by the value pass below */
            load_row(k_cache, row, is_bf16, d, kt[j - j0]);
        }
        score_tile(qh, kt, nk, d, g, scale, s, n, j0);
    }
    for (int gi = 0; gi < g; gi++) {
        float *sg = s + gi * n, m = sg[0], l = 0.f;
        for (int j = 1; j < n; j++) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : l)
        for (int j = 0; j < n; j++) {
            sg[j] = expf(sg[j] - m);
            l += sg[j];
        }
        m_out[gi] = m;
        l_out[gi] = l;
        memset(acc + gi * d, 0, (size_t)d * sizeof(float));
    }
    at_b = t0 / bs, at_o = t0 % bs;
    for (int j = 0; j < n; j++) {
        load_row(v_cache, table[at_b] * sb + at_o * so + head, is_bf16, d, vf);
        if (++at_o == bs) { at_o = 0; at_b++; }
        for (int gi = 0; gi < g; gi++) {
            float p = s[gi * n + j], *a = acc + gi * d;
#pragma omp simd
            for (int i = 0; i < d; i++) a[i] += p * vf[i];
        }
    }
}

/* q [B, H, D]; caches with element strides sb (block), so (offset), sh (KV head); tables [B, table_stride]; lens [B];
 * scratch part_acc [B, KV, nc, G, D], part_ml [B, KV, nc, G, 2]; out o [B, H, D], lse [B, H].
 * nc = chunks of the longest row, chunk <= MAX_CHUNK keys. Returns 0, or -1 for a shape it does not take. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                 const int64_t *tables, int64_t table_stride, const int64_t *lens, int b_rows,
                 int h, int kv, int d, int bs, int64_t sb, int64_t so, int64_t sh, float scale, int chunk, int nc, int threads,
                 float *part_acc, float *part_ml, float *o, float *lse) {
    int g = h / kv;
    if (g > MAX_G || d > MAX_D || g * kv != h || chunk <= 0 || chunk > MAX_CHUNK) return -1;
    int64_t items = (int64_t)b_rows * kv * nc;
#pragma omp parallel num_threads(threads)
    {
        float s[MAX_G * MAX_CHUNK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int c = (int)(it % nc);
            int kvh = (int)((it / nc) % kv);
            int b = (int)(it / ((int64_t)nc * kv));
            int len = (int)lens[b], t0 = c * chunk, t1 = t0 + chunk < len ? t0 + chunk : len;
            float *ml = part_ml + it * g * 2;
            float *acc = part_acc + it * g * d;
            if (t0 >= t1) {
                for (int gi = 0; gi < g; gi++) ml[2 * gi + 1] = 0.f;   /* l = 0: no keys */
                continue;
            }
            float m[MAX_G], l[MAX_G];
            sweep(q + (int64_t)b * h * d, k_cache, v_cache, is_bf16,
                  tables + (int64_t)b * table_stride, t0, t1, d, bs, sb, so, sh, kvh, g, scale, s,
                  acc, m, l);
            for (int gi = 0; gi < g; gi++) {
                ml[2 * gi] = m[gi];
                ml[2 * gi + 1] = l[gi];
            }
        }
        /* merge the chunks of each (sequence, query head) */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < (int64_t)b_rows * h; bh++) {
            int b = (int)(bh / h), head = (int)(bh % h), kvh = head / g, gi = head % g;
            float *out = o + bh * d;
            int64_t base = ((int64_t)b * kv + kvh) * nc;
            float big = -INFINITY, total = 0.f;
            for (int c = 0; c < nc; c++) {
                const float *ml = part_ml + ((base + c) * g + gi) * 2;
                if (ml[1] > 0.f && ml[0] > big) big = ml[0];
            }
            memset(out, 0, (size_t)d * sizeof(float));
            if (big == -INFINITY) {
                lse[bh] = -INFINITY;
                continue;
            }
            for (int c = 0; c < nc; c++) {
                const float *ml = part_ml + ((base + c) * g + gi) * 2;
                if (!(ml[1] > 0.f)) continue;
                float w = expf(ml[0] - big);
                const float *a = part_acc + ((base + c) * g + gi) * d;
                total += ml[1] * w;
#pragma omp simd
                for (int i = 0; i < d; i++) out[i] += a[i] * w;
            }
            float inv = 1.f / total;
#pragma omp simd
            for (int i = 0; i < d; i++) out[i] *= inv;
            lse[bh] = big + logf(total);
        }
    }
    return 0;
}
