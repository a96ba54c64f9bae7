/* A decode step's work between its GEMMs, fp32, one query token per row.
 *
 * Built and loaded by pdchat.core.generation.cpu_kernels, which checks every argument
 * (shapes, dtypes, contiguity) before calling here: these functions take them on trust.
 * Each row is computed alone, in the same order whatever the batch: a row's result
 * does not depend on the rows beside it.
 *
 * Layouts (row-major): a layer's fused projection output qkv [rows, (q_heads + 2 kv_heads)
 * * dim], q then k then v; a layer's pool keys and values [slots, kv_heads, dim]; rotary
 * tables cos and sin [positions, dim] (rotate-half form); read [rows, cols], the slots
 * of each row's positions, with lengths [rows] of them attended over (from the first,
 * or the last `window` when window > 0). Query head h reads kv head h / (q_heads / kv_heads).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PREFETCH_AHEAD 8

static void prefetch_slot(const float *slot, int64_t floats) {
    for (int64_t byte = 0; byte < floats * (int64_t)sizeof(float); byte += 64)
        __builtin_prefetch((const char *)slot + byte);
}

/* out [rows, q_heads, dim]: softmax(q k^T * scale) v for each row's one query, the query
 * of row r at q + r * q_stride. Returns 1 when its scratch cannot be allocated. */
int pdchat_decode_attention(const float *restrict q, int64_t q_stride, const float *restrict keys,
                            const float *restrict values, const int64_t *restrict read,
                            const int64_t *restrict lengths, int64_t rows, int64_t cols, int64_t q_heads,
                            int64_t kv_heads, int64_t dim, float scale, int64_t window, float *restrict out) {
    const int64_t groups = q_heads / kv_heads, width = kv_heads * dim;
    float *scores = malloc(sizeof(float) * (size_t)(q_heads * cols));
    if (scores == NULL) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = lengths[r];
        const int64_t start = (window > 0 && n > window) ? n - window : 0;
        const int64_t *slots = read + r * cols;
        const float *q_row = q + r * q_stride;
        for (int64_t t = start; t < n; t++) {
            if (t + PREFETCH_AHEAD < n) prefetch_slot(keys + slots[t + PREFETCH_AHEAD] * width, width);
            const float *key = keys + slots[t] * width;
            for (int64_t h = 0; h < q_heads; h++) {
                const float *qh = q_row + h * dim, *kh = key + (h / groups) * dim;
                float dot = 0.f;
                for (int64_t i = 0; i < dim; i++) dot += qh[i] * kh[i];
                scores[h * cols + t] = dot * scale;
            }
        }
        for (int64_t h = 0; h < q_heads; h++) {
            float *sh = scores + h * cols;
            float top = -FLT_MAX, total = 0.f;
            for (int64_t t = start; t < n; t++) top = sh[t] > top ? sh[t] : top;
            for (int64_t t = start; t < n; t++) {
                sh[t] = expf(sh[t] - top);
                total += sh[t];
            }
            const float inverse = 1.f / total;
            for (int64_t t = start; t < n; t++) sh[t] *= inverse;
        }
        float *out_row = out + r * q_heads * dim;
        for (int64_t i = 0; i < q_heads * dim; i++) out_row[i] = 0.f;
        for (int64_t t = start; t < n; t++) {
            if (t + PREFETCH_AHEAD < n) prefetch_slot(values + slots[t + PREFETCH_AHEAD] * width, width);
            const float *value = values + slots[t] * width;
            for (int64_t h = 0; h < q_heads; h++) {
                const float weight = scores[h * cols + t], *vh = value + (h / groups) * dim;
                float *oh = out_row + h * dim;
                for (int64_t i = 0; i < dim; i++) oh[i] += weight * vh[i];
            }
        }
    }
    free(scores);
    return 0;
}

static void norm_row(const float *restrict x, const float *restrict weight, int64_t width, float eps,
                     float *restrict out) {
    float squares = 0.f;
    for (int64_t i = 0; i < width; i++) squares += x[i] * x[i];
    const float inverse = 1.f / sqrtf(squares / (float)width + eps);
    for (int64_t i = 0; i < width; i++) out[i] = x[i] * inverse * weight[i];
}

/* out [rows, width] = RMSNorm(x) * weight. */
void pdchat_rms_norm(const float *restrict x, const float *restrict weight, int64_t rows, int64_t width, float eps,
                     float *restrict out) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, weight, width, eps, out + r * width);
}

/* hidden += delta (the residual), then out = RMSNorm(hidden) * weight; all [rows, width]. */
void pdchat_add_rms_norm(float *restrict hidden, const float *restrict delta, const float *restrict weight,
                         int64_t rows, int64_t width, float eps, float *restrict out) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * width;
        const float *d = delta + r * width;
        for (int64_t i = 0; i < width; i++) h[i] += d[i];
        norm_row(h, weight, width, eps, out + r * width);
    }
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] holding gate then up.
 * NOTE: exp's argument is capped at 80: past about 88.7 expf overflows to inf, and
 * -ffast-math's reciprocal turns gate / inf into NaN (silu there is -0 to float precision). */
void pdchat_silu_mul(const float *restrict gate_up, int64_t rows, int64_t inter, float *restrict out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = gate[i] / (1.f + expf(fminf(-gate[i], 80.f))) * up[i];
    }
}

static void rotate_half(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float first = x[i], second = x[i + half];
        x[i] = first * cos[i] - second * sin[i];
        x[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

/* Rotate each row's q and k heads in place in qkv (at the row's position), then store its
 * k and v in the pool at the row's write slot. */
void pdchat_rope_store(float *restrict qkv, const float *restrict cos, const float *restrict sin,
                       const int64_t *restrict positions, const int64_t *restrict write, float *restrict keys,
                       float *restrict values, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t dim) {
    const int64_t stride = (q_heads + 2 * kv_heads) * dim, width = kv_heads * dim;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * stride;
        const float *c = cos + positions[r] * dim, *s = sin + positions[r] * dim;
        for (int64_t h = 0; h < q_heads + kv_heads; h++) rotate_half(row + h * dim, c, s, dim);
        const float *k = row + q_heads * dim, *v = k + width;
        float *key = keys + write[r] * width, *value = values + write[r] * width;
        for (int64_t i = 0; i < width; i++) {
            key[i] = k[i];
            value[i] = v[i];
        }
    }
}

/* out [rows]: the index of each row's largest value, the first on a tie (as torch.argmax
 * for finite values). */
void pdchat_argmax(const float *restrict x, int64_t rows, int64_t cols, int64_t *restrict out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        float best = row[0];
        int64_t at = 0;
        for (int64_t i = 1; i < cols; i++) {
            if (row[i] > best) {
                best = row[i];
                at = i;
            }
        }
        out[r] = at;
    }
}

/* The greedy token of a vocabulary projection, screened in bf16 and decided in double.
 *
 * packed: W [n, k] in bf16 (round to nearest even), as [n / 16][k / 2][16][2]: sixteen
 * vocabulary rows' pairs of columns side by side, what AVX-512 BF16's dot product takes
 * (AVX2 widens each pair to two fp32 lanes).
 * pdchat_pack_head_bf16 writes it; n % 16 == 0 and k even.
 *
 * pdchat_head_argmax: for each row r of x [rows, k], approx[v] = x~ . w~_v (x and W in
 * bf16, sums in fp32), bounded: |approx[v] - x . w_v| <= slack_scale * |x| * norms[v] +
 * slack_floor, where the caller's slack covers bf16's rounding, fp32's sums and the
 * flushing of denormals (Cauchy-Schwarz bounds sum |x_i w_vi| by |x| |w_v|). Every v
 * whose upper bound reaches the largest lower bound is a candidate, and the true argmax
 * is among them; each is recomputed in double from the fp32 W, and out[r] is the largest
 * (the first on a tie). out[r] = -1 where more than max_candidates qualify: the caller
 * then computes that row's logits in full. scratch: rows * n floats. The caller passes
 * only finite x. Returns 0, or -1 where this build has neither AVX-512 BF16 nor AVX2 with
 * FMA (nothing written).
 */
static uint16_t to_bf16(float value) {
    union { float f; uint32_t u; } bits = {value};
    return (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
}

void pdchat_pack_head_bf16(const float *restrict w, int64_t n, int64_t k, uint16_t *restrict packed) {
    for (int64_t block = 0; block < n / 16; block++)
        for (int64_t pair = 0; pair < k / 2; pair++)
            for (int64_t lane = 0; lane < 16; lane++)
                for (int64_t half = 0; half < 2; half++)
                    packed[((block * (k / 2) + pair) * 16 + lane) * 2 + half] =
                        to_bf16(w[(block * 16 + lane) * k + pair * 2 + half]);
}

static int64_t decide_row(const float *restrict x, int64_t k, const float *restrict w, const float *restrict norms,
                          int64_t n, const float *restrict approx, float slack_scale, float slack_floor,
                          int64_t max_candidates) {
    double squares = 0.0;
    for (int64_t i = 0; i < k; i++) squares += (double)x[i] * x[i];
    const float scale = (float)(sqrt(squares) * slack_scale);
    float floor_ = -FLT_MAX;
    for (int64_t v = 0; v < n; v++) {
        float lower = approx[v] - (scale * norms[v] + slack_floor);
        if (lower > floor_) floor_ = lower;
    }
    int64_t candidates = 0, best = -1;
    double best_value = 0.0;
    for (int64_t v = 0; v < n; v++) {
        if (approx[v] + (scale * norms[v] + slack_floor) < floor_) continue;
        if (++candidates > max_candidates) return -1;
        const float *row = w + v * k;
        double value = 0.0;
        for (int64_t i = 0; i < k; i++) value += (double)x[i] * row[i];
        if (best < 0 || value > best_value) {
            best = v;
            best_value = value;
        }
    }
    return best;
}
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAS_SCREEN 1

/* approx [R, n] (row stride n) of R rows of pairs [R, k / 2] (row stride k / 2). */
#define SCREEN_TILE(R)                                                                             \
    static void screen_tile_##R(const uint32_t *restrict pairs, int64_t half_k,                    \
                                const uint16_t *restrict packed, int64_t n, float *restrict approx) { \
        for (int64_t block = 0; block < n / 16; block++) {                                        \
            const uint16_t *w = packed + block * half_k * 32;                                     \
            __m512 acc[R];                                                                        \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();    \
            for (int64_t j = 0; j < half_k; j++) {                                                \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * 32);                           \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] = _mm512_dpbf16_ps(   \
                    acc[r], (__m512bh)_mm512_set1_epi32((int)pairs[r * half_k + j]), wv);         \
            }                                                                                     \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                  \
                _mm512_storeu_ps(approx + r * n + block * 16, acc[r]);                            \
        }                                                                                         \
    }
SCREEN_TILE(1)
SCREEN_TILE(4)
SCREEN_TILE(8)
SCREEN_TILE(16)

/* The screen's approx [rows, n] by AVX-512 BF16's pair dot products: x in bf16 pairs. */
static int screen(const float *restrict x, int64_t rows, int64_t k, const uint16_t *restrict packed, int64_t n,
                  float *restrict scratch) {
    const int64_t half_k = k / 2;
    uint32_t *pairs = malloc((size_t)(rows * half_k) * sizeof(uint32_t));
    if (pairs == NULL) return -2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < half_k; j++)
            pairs[r * half_k + j] =
                (uint32_t)to_bf16(x[r * k + 2 * j]) | ((uint32_t)to_bf16(x[r * k + 2 * j + 1]) << 16);
    for (int64_t r = 0; r < rows;) {
        const int64_t left = rows - r, tile = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : 1;
        const uint32_t *tile_pairs = pairs + r * half_k;
        float *approx = scratch + r * n;
        if (tile == 16) screen_tile_16(tile_pairs, half_k, packed, n, approx);
        else if (tile == 8) screen_tile_8(tile_pairs, half_k, packed, n, approx);
        else if (tile == 4) screen_tile_4(tile_pairs, half_k, packed, n, approx);
        else screen_tile_1(tile_pairs, half_k, packed, n, approx);
        r += tile;
    }
    free(pairs);
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_SCREEN 1

/* One block of 16 vocabulary rows for R rows of xs [R, k] (x rounded to bf16, held as
 * fp32): each bf16 pair widened to two fp32 lanes, then FMAs. A bf16 times a bf16 is exact
 * in fp32, so each approx is the same sum of the same products as AVX-512 BF16's, in
 * another order: the caller's bound covers both. */
#define SCREEN_TILE_AVX2(R)                                                                        \
    static void screen_block_##R(const float *restrict xs, int64_t k, const uint16_t *restrict w,  \
                                 int64_t n, float *restrict approx) {                              \
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);                                 \
        __m256 acc[R][2];                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(); \
        for (int64_t j = 0; j < k / 2; j++) {                                                     \
            const __m256i p0 = _mm256_loadu_si256((const __m256i *)(w + j * 32));                 \
            const __m256i p1 = _mm256_loadu_si256((const __m256i *)(w + j * 32 + 16));            \
            const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));                  \
            const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high));                  \
            const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));                  \
            const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high));                  \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                 \
                const __m256 a = _mm256_broadcast_ss(xs + r * k + 2 * j);                         \
                const __m256 b = _mm256_broadcast_ss(xs + r * k + 2 * j + 1);                     \
                acc[r][0] = _mm256_fmadd_ps(b, odd0, _mm256_fmadd_ps(a, even0, acc[r][0]));       \
                acc[r][1] = _mm256_fmadd_ps(b, odd1, _mm256_fmadd_ps(a, even1, acc[r][1]));       \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                     \
            _mm256_storeu_ps(approx + r * n, acc[r][0]);                                          \
            _mm256_storeu_ps(approx + r * n + 8, acc[r][1]);                                      \
        }                                                                                         \
    }
SCREEN_TILE_AVX2(1)
SCREEN_TILE_AVX2(2)
SCREEN_TILE_AVX2(3)
SCREEN_TILE_AVX2(4)

/* The screen's approx [rows, n] by AVX2 FMAs: each block of the weight (k * 32 bytes,
 * in L1) serves every row, four at a time, before the next block is read. */
static int screen(const float *restrict x, int64_t rows, int64_t k, const uint16_t *restrict packed, int64_t n,
                  float *restrict scratch) {
    float *xs = malloc((size_t)(rows * k) * sizeof(float));
    if (xs == NULL) return -2;
    for (int64_t i = 0; i < rows * k; i++) {
        union { uint32_t u; float f; } bits = {(uint32_t)to_bf16(x[i]) << 16};
        xs[i] = bits.f;
    }
    for (int64_t block = 0; block < n / 16; block++) {
        const uint16_t *w = packed + block * (k / 2) * 32;
        for (int64_t r = 0; r < rows;) {
            const int64_t tile = rows - r >= 4 ? 4 : rows - r;
            const float *tile_x = xs + r * k;
            float *approx = scratch + r * n + block * 16;
            if (tile == 4) screen_block_4(tile_x, k, w, n, approx);
            else if (tile == 3) screen_block_3(tile_x, k, w, n, approx);
            else if (tile == 2) screen_block_2(tile_x, k, w, n, approx);
            else screen_block_1(tile_x, k, w, n, approx);
            r += tile;
        }
    }
    free(xs);
    return 0;
}
#endif

int pdchat_head_argmax(const float *restrict x, int64_t rows, int64_t k, const uint16_t *restrict packed,
                       const float *restrict w, const float *restrict norms, int64_t n, float slack_scale,
                       float slack_floor, int64_t max_candidates, float *restrict scratch, int64_t *restrict out) {
#ifdef HAS_SCREEN
    if (rows <= 0) return 0;
    const int status = screen(x, rows, k, packed, n, scratch);
    if (status != 0) return status;
    for (int64_t r = 0; r < rows; r++)
        out[r] = decide_row(x + r * k, k, w, norms, n, scratch + r * n, slack_scale, slack_floor, max_candidates);
    return 0;
#else
    (void)x; (void)rows; (void)k; (void)packed; (void)w; (void)norms; (void)n; (void)slack_scale;
    (void)slack_floor; (void)max_candidates; (void)scratch; (void)out;
    return -1;
#endif
}

/*
 * pdchat_decide_rows: pdchat_head_argmax's decision on logits [rows, n] the caller computed
 * in fp32 (its GEMM, any summation order), bounded as there by a slack_scale that covers
 * fp32's sums alone: the same exact argmax (the first on a tie), -1 where more than
 * max_candidates qualify. Plain C: needs no AVX-512 BF16.
 */
void pdchat_decide_rows(const float *restrict x, int64_t rows, int64_t k, const float *restrict w,
                        const float *restrict norms, int64_t n, const float *restrict logits, float slack_scale,
                        float slack_floor, int64_t max_candidates, int64_t *restrict out) {
    for (int64_t r = 0; r < rows; r++)
        out[r] = decide_row(x + r * k, k, w, norms, n, logits + r * n, slack_scale, slack_floor, max_candidates);
}
