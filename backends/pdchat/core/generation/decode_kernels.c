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
