/* One decode step's attention over a paged KV pool, fp32, one query token per row.
 *
 * Built and loaded by pdchat.core.generation.cpu_attention, which states the contract.
 * Shapes (all contiguous): q and out [rows, q_heads, dim]; keys and values one layer's
 * pool, [slots, kv_heads, dim]; read [rows, cols], the slots of each row's positions;
 * lengths [rows], how many of them the row attends over (from its first, or its last
 * `window` when window > 0). Query head h reads kv head h / (q_heads / kv_heads).
 * Each row is computed alone, in the same order whatever the batch: a row's result
 * does not depend on the rows beside it.
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

int pdchat_decode_attention(const float *restrict q, const float *restrict keys, const float *restrict values,
                            const int64_t *restrict read, const int64_t *restrict lengths, int64_t rows,
                            int64_t cols, int64_t q_heads, int64_t kv_heads, int64_t dim, float scale,
                            int64_t window, float *restrict out) {
    const int64_t groups = q_heads / kv_heads, width = kv_heads * dim;
    float *scores = malloc(sizeof(float) * (size_t)(q_heads * cols));
    if (scores == NULL) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = lengths[r];
        const int64_t start = (window > 0 && n > window) ? n - window : 0;
        const int64_t *slots = read + r * cols;
        const float *q_row = q + r * q_heads * dim;
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
