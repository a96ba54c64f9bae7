/* A decode step's work between its GEMMs, fp32, one query token per row; and a prompt
 * chunk's attention (AVX-512 only).
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
 *
 * Threads: the row kernels and the head's screen split their rows (or the vocabulary's blocks)
 * over pdchat_set_threads' count, through OpenMP (torch's own runtime: the same libgomp is
 * loaded first), when there is work for more than one: a prompt's pass on a stage that took
 * more threads while its cores sat idle. Each row or block is still computed alone, so the
 * results do not depend on the threads. The prompt attention splits its (query head, block
 * of queries) tasks the same way; each task is computed alone.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_AVX2_FMA 1
#endif

#define PREFETCH_AHEAD 8
/* Rows below which a kernel stays on the calling thread (a parallel region costs microseconds). */
#define PARALLEL_ROWS 16

static int pass_threads = 1;

/* The threads the kernels below may split their work over (1: the calling thread alone). */
void pdchat_set_threads(int threads) { pass_threads = threads > 1 ? threads : 1; }

#define PRAGMA(text) _Pragma(#text)
/* Before a for loop over `count` independent rows (or blocks): split it over pass_threads. */
#define SPLIT_ROWS(count) \
    PRAGMA(omp parallel for num_threads(pass_threads) schedule(static) if(pass_threads > 1 && (count) >= PARALLEL_ROWS))

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

#if defined(__AVX512F__)
#define TILE 16       /* keys per tile: one zmm of scores per query */
#define QUERY_BLOCK 8 /* queries per block: eight score accumulators */
#define MAX_DIM 256

/* e^x for x <= 0 (softmax's shifted scores), about 2 ulp: 2^(x log2 e) split into an
 * integer power (scalef) and a degree-6 polynomial of the rest. -inf gives 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f)); /* |f| <= ln2/2 */
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The largest head dim pdchat_prompt_attention takes; 0 where it was not compiled (no AVX-512). */
int pdchat_prompt_attention_max_dim(void) { return MAX_DIM; }

/* One head's block of `rows` queries (at most QUERY_BLOCK; row r at `position` + r, its q
 * at q + r * q_stride) over its kv head's packed tiles (pdchat_prompt_attention), each
 * tile's scores folded into the rows' running max, sum and weighted values (online
 * softmax); row r of the result at out + r * out_stride. */
static void attend_block(const float *restrict q, int64_t q_stride, const float *restrict packed, int64_t rows,
                         int64_t position, int64_t dim, float scale, float *restrict out, int64_t out_stride) {
    const int64_t tile_floats = TILE * dim, vectors = dim / 16;
    float qs[QUERY_BLOCK][MAX_DIM] __attribute__((aligned(64)));
    float acc[QUERY_BLOCK][MAX_DIM] __attribute__((aligned(64)));
    float p[QUERY_BLOCK][TILE] __attribute__((aligned(64)));
    float top[QUERY_BLOCK], total[QUERY_BLOCK];
    for (int64_t r = 0; r < QUERY_BLOCK; r++) { /* rows past `rows` repeat the first: computed, never read */
        const float *src = q + (r < rows ? r : 0) * q_stride;
        for (int64_t d = 0; d < dim; d++) qs[r][d] = src[d] * scale;
        memset(acc[r], 0, sizeof(float) * (size_t)dim);
        top[r] = -INFINITY;
        total[r] = 0.f;
    }
    for (int64_t tile = 0; tile * TILE <= position + rows - 1; tile++) {
        const float *kt = packed + tile * 2 * tile_floats, *vt = kt + tile_floats;
        __m512 s[QUERY_BLOCK];
        for (int r = 0; r < QUERY_BLOCK; r++) s[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 k = _mm512_load_ps(kt + d * TILE);
            for (int r = 0; r < QUERY_BLOCK; r++) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), k, s[r]);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t seen = position + r - tile * TILE + 1; /* this tile's columns row r attends over */
            const __mmask16 keep = seen >= TILE ? (__mmask16)0xFFFF : seen <= 0 ? (__mmask16)0 : (__mmask16)((1u << seen) - 1u);
            const __m512 masked = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, s[r]);
            const float tile_top = _mm512_reduce_max_ps(masked);
            const float new_top = tile_top > top[r] ? tile_top : top[r];
            const float fade = top[r] == -INFINITY ? 0.f : expf(top[r] - new_top);
            const __m512 e = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(masked, _mm512_set1_ps(new_top))));
            _mm512_store_ps(p[r], e);
            total[r] = total[r] * fade + _mm512_reduce_add_ps(e);
            top[r] = new_top;
            if (fade != 1.f)
                for (int64_t v = 0; v < vectors; v++)
                    _mm512_store_ps(acc[r] + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * v), _mm512_set1_ps(fade)));
        }
        for (int r = 0; r < rows; r += 2) { /* two rows' sums in registers per tile, one value load each */
            const int second = r + 1 < rows ? r + 1 : r;
            for (int64_t v = 0; v < vectors; v++) {
                __m512 a0 = _mm512_load_ps(acc[r] + 16 * v), a1 = _mm512_load_ps(acc[second] + 16 * v);
                for (int j = 0; j < TILE; j++) {
                    const __m512 value = _mm512_load_ps(vt + j * dim + 16 * v);
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), value, a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[second][j]), value, a1);
                }
                if (second != r) _mm512_store_ps(acc[second] + 16 * v, a1);
                _mm512_store_ps(acc[r] + 16 * v, a0);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inverse = 1.f / total[r];
        for (int64_t d = 0; d < dim; d++) out[r * out_stride + d] = acc[r][d] * inverse;
    }
}

/* out [queries, q_heads, dim]: causal softmax(q k^T * scale) v of one prompt's chunk, query
 * i at position n - queries + i attending over columns 0..its position, whose keys and
 * values lie in a layer's pool at slots read[0..n); q's rows `q_stride` floats apart; dim a
 * multiple of 16, at most MAX_DIM. Flash-style: each kv head's keys and values are packed
 * once into tiles of TILE columns (keys transposed), then each block of QUERY_BLOCK queries
 * of its heads walks the tiles it sees (attend_block), so no score matrix is held and the
 * tiles past a block's last position are skipped. Returns 1 when its scratch cannot be
 * allocated. */
int pdchat_prompt_attention(const float *restrict q, int64_t q_stride, const float *restrict keys,
                            const float *restrict values, const int64_t *restrict read, int64_t queries, int64_t n,
                            int64_t q_heads, int64_t kv_heads, int64_t dim, float scale, float *restrict out) {
    const int64_t groups = q_heads / kv_heads, width = kv_heads * dim, tiles = (n + TILE - 1) / TILE;
    const int64_t tile_floats = TILE * dim;
    const int64_t blocks = (queries + QUERY_BLOCK - 1) / QUERY_BLOCK, first = n - queries;
    /* One kv head's tiles at a time: its keys transposed ([dim][TILE]), then its values
     * ([TILE][dim]); zero past n. */
    float *packed = aligned_alloc(64, sizeof(float) * (size_t)(tiles * 2 * tile_floats));
    if (packed == NULL) return 1;
    for (int64_t h = 0; h < kv_heads; h++) {
        PRAGMA(omp parallel for num_threads(pass_threads) schedule(static) if(pass_threads > 1 && tiles >= PARALLEL_ROWS))
        for (int64_t tile = 0; tile < tiles; tile++) {
            float *kt = packed + tile * 2 * tile_floats, *vt = kt + tile_floats;
            for (int64_t j = 0; j < TILE; j++) {
                const int64_t col = tile * TILE + j;
                const float *key = col < n ? keys + read[col] * width + h * dim : NULL;
                const float *value = col < n ? values + read[col] * width + h * dim : NULL;
                for (int64_t d = 0; d < dim; d++) {
                    kt[d * TILE + j] = key ? key[d] : 0.f;
                    vt[j * dim + d] = value ? value[d] : 0.f;
                }
            }
        }
        PRAGMA(omp parallel for num_threads(pass_threads) schedule(dynamic) if(pass_threads > 1 && groups * blocks >= PARALLEL_ROWS))
        for (int64_t task = 0; task < groups * blocks; task++) {
            const int64_t head = h * groups + task / blocks, i0 = (task % blocks) * QUERY_BLOCK;
            const int64_t rows = queries - i0 < QUERY_BLOCK ? queries - i0 : QUERY_BLOCK;
            attend_block(q + i0 * q_stride + head * dim, q_stride, packed, rows, first + i0, dim, scale,
                         out + (i0 * q_heads + head) * dim, q_heads * dim);
        }
    }
    free(packed);
    return 0;
}
#else
int pdchat_prompt_attention_max_dim(void) { return 0; }
int pdchat_prompt_attention(const float *q, int64_t q_stride, const float *keys, const float *values,
                            const int64_t *read, int64_t queries, int64_t n, int64_t q_heads, int64_t kv_heads,
                            int64_t dim, float scale, float *out) {
    (void)q, (void)q_stride, (void)keys, (void)values, (void)read, (void)queries, (void)n;
    (void)q_heads, (void)kv_heads, (void)dim, (void)scale, (void)out;
    return 1; /* never called: pdchat_prompt_attention_max_dim says 0 */
}
#endif

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
    SPLIT_ROWS(rows)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, weight, width, eps, out + r * width);
}

/* hidden += delta (the residual), then out = RMSNorm(hidden) * weight; all [rows, width]. */
void pdchat_add_rms_norm(float *restrict hidden, const float *restrict delta, const float *restrict weight,
                         int64_t rows, int64_t width, float eps, float *restrict out) {
    SPLIT_ROWS(rows)
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
    SPLIT_ROWS(rows)
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
    SPLIT_ROWS(rows)
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

/* The greedy token of a vocabulary projection: its logits screened with a bound on their
 * error, the few close to the best decided in double.
 *
 * Two screens; a build has those its CPU can run, and pdchat_head_screens() says which:
 *
 * HEAD_BF16 (AVX-512 BF16, or AVX2 with FMA): packed W [n, k] in bf16 (round to nearest even), as
 * [n / 16][k / 2][16][2] (sixteen vocabulary rows' pairs of columns side by side, what the
 * pair dot product takes, AVX2 widening each pair to two fp32 lanes; pdchat_pack_head_bf16
 * writes it; n % 16 == 0, k even). approx[v]
 * = x~ . w~_v (x and W in bf16, sums in fp32), and |approx[v] - x . w_v| <= err_scale *
 * |x| * err_norms[v] + slack_floor, the caller's err_scale covering bf16's rounding and
 * fp32's sums (Cauchy-Schwarz bounds sum |x_i w_vi| by |x| |w_v|); q_norms unused.
 *
 * HEAD_INT8 (AVX2): packed W in int8, q_v = round(w_v / s_v) with s_v = max |w_v| / 64, as
 * [n / 8][k / 4][8][4] (eight vocabulary rows' quads of columns side by side); scales[v] =
 * s_v; offsets[v] = 128 * sum_i q_vi; err_norms[v] >= |w_v - s_v q_v|; q_norms[v] >=
 * |s_v q_v| (n % 8 == 0, k % 4 == 0: the caller packs it). Each row of x is quantized
 * alone, p = round(x / t) with t = max |x| / 127, and x . w_v = t s_v (p . q_v) + x . (w_v
 * - s_v q_v) + (x - t p) . s_v q_v: the integer dot is exact (AVX2's u8 x s8 pairs, p
 * offset by 128 into u8: 255 * 64 * 2 fits int16), and the two other terms are bounded by
 * |x| err_norms[v] and |x - t p| q_norms[v]; 2^-21 |t p| q_norms[v] covers the floats the
 * approx and its bound are rounded to. A row with max |x| outside [2^-30, 2^32] comes back
 * -1 (the caller keeps max |w| in [2^-60, 2^32] for rows not all zero: no float in here
 * underflows or overflows).
 *
 * Every v whose upper bound reaches the largest lower bound is a candidate, and the true
 * argmax is among them; each is recomputed in double from the fp32 W, and out[r] is the
 * largest (the first on a tie). out[r] = -1 where more than max_candidates qualify: the
 * caller then computes that row's logits in full. scratch: rows * n floats. The caller
 * passes only finite x. Returns 0, or -1 where the build has no screen (nothing written).
 */
#define HEAD_BF16 1
#define HEAD_INT8 2

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

static double norm_of(const float *restrict x, int64_t k) {
    double squares = 0.0;
    for (int64_t i = 0; i < k; i++) squares += (double)x[i] * x[i];
    return sqrt(squares);
}

/* A row's decision so far: the candidates taken, and the best of them (-1: none yet). */
typedef struct {
    int64_t candidates, best;
    double best_value;
} Decision;

/* Take v as a candidate: its logit x . w_v in double (each product exact, the sum in
 * order), kept when larger than the best before it (the first wins a tie). False once
 * more than max_candidates were taken. */
static int take_candidate(Decision *decision, const float *restrict x, const float *restrict w, int64_t k, int64_t v,
                          int64_t max_candidates) {
    if (++decision->candidates > max_candidates) return 0;
    const float *row = w + v * k;
    double value = 0.0;
    for (int64_t i = 0; i < k; i++) value += (double)x[i] * row[i];
    if (decision->best < 0 || value > decision->best_value) {
        decision->best = v;
        decision->best_value = value;
    }
    return 1;
}

/* The exact argmax among approx's candidates, each v's slack being
 * err_scale * err_norms[v] + q_scale * q_norms[v] + slack_floor. */
static int64_t decide_row(const float *restrict x, int64_t k, const float *restrict w, int64_t n,
                          const float *restrict approx, const float *restrict err_norms, float err_scale,
                          const float *restrict q_norms, float q_scale, float slack_floor, int64_t max_candidates) {
    float floor_ = -FLT_MAX;
    for (int64_t v = 0; v < n; v++) {
        float lower = approx[v] - (err_scale * err_norms[v] + q_scale * q_norms[v] + slack_floor);
        if (lower > floor_) floor_ = lower;
    }
    Decision decision = {0, -1, 0.0};
    int64_t v = 0;
#ifdef HAS_AVX2_FMA
    /* Eight v at a time, the tail one at a time below: the same upper bound, its float
     * operations in an order -ffast-math may pick for the scalar loop too (the slack's
     * margin covers either); only the lanes that reach the floor go on, in order of v. */
    const __m256 floors = _mm256_set1_ps(floor_), errs = _mm256_set1_ps(err_scale), qs = _mm256_set1_ps(q_scale);
    const __m256 slack = _mm256_set1_ps(slack_floor);
    for (; v + 8 <= n; v += 8) {
        const __m256 q_slack = _mm256_mul_ps(qs, _mm256_loadu_ps(q_norms + v));
        const __m256 v_slack = _mm256_fmadd_ps(errs, _mm256_loadu_ps(err_norms + v), q_slack);
        const __m256 upper = _mm256_add_ps(_mm256_loadu_ps(approx + v), _mm256_add_ps(v_slack, slack));
        for (int reach = _mm256_movemask_ps(_mm256_cmp_ps(upper, floors, _CMP_GE_OQ)); reach; reach &= reach - 1)
            if (!take_candidate(&decision, x, w, k, v + __builtin_ctz((unsigned)reach), max_candidates)) return -1;
    }
#endif
    for (; v < n; v++) {
        if (approx[v] + (err_scale * err_norms[v] + q_scale * q_norms[v] + slack_floor) < floor_) continue;
        if (!take_candidate(&decision, x, w, k, v, max_candidates)) return -1;
    }
    return decision.best;
}
#if defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#include <string.h>
#endif

#if defined(__AVX512BF16__)
#define HAS_BF16_SCREEN 1

/* approx [R, n] (row stride n) of R rows of pairs [R, k / 2] (row stride k / 2). */
#define SCREEN_TILE(R)                                                                             \
    static void screen_tile_##R(const uint32_t *restrict pairs, int64_t half_k,                    \
                                const uint16_t *restrict packed, int64_t n, float *restrict approx) { \
        SPLIT_ROWS(n / 16)                                                                        \
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

/* The bf16 screen's approx [rows, n] by AVX-512 BF16's pair dot products. */
static int screen_bf16(const float *restrict x, int64_t rows, int64_t k, const uint16_t *restrict packed, int64_t n,
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

#elif defined(HAS_AVX2_FMA)
#define HAS_BF16_SCREEN 1

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

/* The bf16 screen's approx [rows, n] by AVX2 FMAs: each block of the weight (k * 32 bytes,
 * in L1) serves every row, four at a time, before the next block is read. */
static int screen_bf16(const float *restrict x, int64_t rows, int64_t k, const uint16_t *restrict packed, int64_t n,
                       float *restrict scratch) {
    float *xs = malloc((size_t)(rows * k) * sizeof(float));
    if (xs == NULL) return -2;
    for (int64_t i = 0; i < rows * k; i++) {
        union { uint32_t u; float f; } bits = {(uint32_t)to_bf16(x[i]) << 16};
        xs[i] = bits.f;
    }
    SPLIT_ROWS(n / 16)
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

#if defined(__AVX2__)
#define HAS_INT8_SCREEN 1

/* One block of 8 vocabulary rows (w: k / 4 quads of 32 bytes) for R rows of xu [R, k]
 * (p + 128): approx[r][lane] = t[r] * scales[lane] * (xu . q - offsets[lane]). */
#define INT8_BLOCK(R)                                                                                \
    static void int8_block_##R(const uint8_t *restrict xu, const float *restrict t, int64_t k,       \
                               const int8_t *restrict w, const float *restrict scales,               \
                               const int32_t *restrict offsets, int64_t n, float *restrict approx) { \
        const __m256i ones = _mm256_set1_epi16(1);                                                   \
        __m256i acc[R];                                                                              \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();         \
        for (int64_t j = 0; j < k / 4; j++) {                                                        \
            const __m256i quads = _mm256_loadu_si256((const __m256i *)(w + j * 32));                 \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                    \
                int32_t four;                                                                        \
                memcpy(&four, xu + r * k + 4 * j, sizeof four);                                      \
                const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(four), quads);          \
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));                   \
            }                                                                                        \
        }                                                                                            \
        const __m256i offset = _mm256_loadu_si256((const __m256i *)offsets);                         \
        const __m256 scale = _mm256_loadu_ps(scales);                                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                        \
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], offset));                 \
            const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(t[r]));                     \
            _mm256_storeu_ps(approx + r * n, _mm256_mul_ps(dot, row_scale));                         \
        }                                                                                            \
    }
INT8_BLOCK(1)
INT8_BLOCK(2)
INT8_BLOCK(4)
INT8_BLOCK(8)

/* Row r of x quantized into xu (p + 128) and t[r]; its slack scales: err_scales[r] >= |x|,
 * q_scales[r] >= |x - t p| + 2^-21 |t p|. False for a row out of the screen's range. */
static int quantize_row(const float *restrict x, int64_t k, uint8_t *restrict xu, float *restrict t,
                        float *restrict err_scale, float *restrict q_scale) {
    float largest = 0.0f;
    for (int64_t i = 0; i < k; i++) largest = fmaxf(largest, fabsf(x[i]));
    if (!(largest >= 0x1p-30f && largest <= 0x1p32f)) return 0;
    const float step = largest / 127.0f;
    double residual = 0.0, quantized = 0.0;
    for (int64_t i = 0; i < k; i++) {
        float p = rintf(x[i] / step);
        p = fminf(fmaxf(p, -127.0f), 127.0f);
        xu[i] = (uint8_t)((int)p + 128);
        const double left = (double)x[i] - (double)step * p;
        residual += left * left;
        quantized += (double)p * p;
    }
    *t = step;
    *err_scale = (float)(norm_of(x, k) * 1.01);
    *q_scale = (float)((sqrt(residual) + 0x1p-21 * step * sqrt(quantized)) * 1.01);
    return 1;
}

/* The screen's approx [rows, n] in int8, each block of the weight (k * 8 bytes, in L1)
 * serving every row, eight at a time, before the next is read. A row out of range gets
 * err_scales[r] = -1 (undecided). */
static int screen_int8(const float *restrict x, int64_t rows, int64_t k, const int8_t *restrict packed,
                       const float *restrict scales, const int32_t *restrict offsets, int64_t n,
                       float *restrict scratch, float *restrict err_scales, float *restrict q_scales) {
    uint8_t *xu = malloc((size_t)(rows * k));
    float *t = malloc((size_t)rows * sizeof(float));
    if (xu == NULL || t == NULL) {
        free(xu);
        free(t);
        return -2;
    }
    for (int64_t r = 0; r < rows; r++)
        if (!quantize_row(x + r * k, k, xu + r * k, t + r, err_scales + r, q_scales + r)) {
            memset(xu + r * k, 128, (size_t)k);  /* screened as zeros, then left undecided */
            t[r] = 0.0f;
            err_scales[r] = -1.0f;
        }
    SPLIT_ROWS(n / 8)
    for (int64_t block = 0; block < n / 8; block++) {
        const int8_t *w = packed + block * k * 8;
        for (int64_t r = 0; r < rows;) {
            const int64_t left = rows - r, tile = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const uint8_t *tile_x = xu + r * k;
            float *approx = scratch + r * n + block * 8;
            const float *s = scales + block * 8;
            const int32_t *o = offsets + block * 8;
            if (tile == 8) int8_block_8(tile_x, t + r, k, w, s, o, n, approx);
            else if (tile == 4) int8_block_4(tile_x, t + r, k, w, s, o, n, approx);
            else if (tile == 2) int8_block_2(tile_x, t + r, k, w, s, o, n, approx);
            else int8_block_1(tile_x, t + r, k, w, s, o, n, approx);
            r += tile;
        }
    }
    free(xu);
    free(t);
    return 0;
}
#endif

/* Which screens this library was compiled with: HEAD_BF16 | HEAD_INT8, or 0. */
int pdchat_head_screens(void) {
    int screens = 0;
#ifdef HAS_BF16_SCREEN
    screens |= HEAD_BF16;
#endif
#ifdef HAS_INT8_SCREEN
    screens |= HEAD_INT8;
#endif
    return screens;
}

/* Screen `screen` (HEAD_BF16: packed bf16, err_scale, scales/offsets/q_norms unused;
 * HEAD_INT8: packed int8 with its scales, offsets and q_norms), then decide each row. */
int pdchat_head_argmax(int screen, const float *restrict x, int64_t rows, int64_t k, const void *restrict packed,
                       const float *restrict scales, const int32_t *restrict offsets, const float *restrict w,
                       const float *restrict err_norms, const float *restrict q_norms, int64_t n, float err_scale,
                       float slack_floor, int64_t max_candidates, float *restrict scratch, int64_t *restrict out) {
    (void)packed; (void)scales; (void)offsets; (void)err_scale;  /* unused by a build without the screen */
    if (!(pdchat_head_screens() & screen)) return -1;
    if (rows <= 0) return 0;
    float *slacks = malloc((size_t)(2 * rows) * sizeof(float));
    if (slacks == NULL) return -2;
    int status = -1;
#ifdef HAS_BF16_SCREEN
    if (screen == HEAD_BF16) {
        status = screen_bf16(x, rows, k, packed, n, scratch);
        for (int64_t r = 0; r < rows; r++) {
            slacks[r] = (float)(norm_of(x + r * k, k) * err_scale);
            slacks[rows + r] = 0.0f;
        }
    }
#endif
#ifdef HAS_INT8_SCREEN
    if (screen == HEAD_INT8)
        status = screen_int8(x, rows, k, packed, scales, offsets, n, scratch, slacks, slacks + rows);
#endif
    for (int64_t r = 0; r < rows && status == 0; r++)
        out[r] = slacks[r] < 0.0f ? -1
                                  : decide_row(x + r * k, k, w, n, scratch + r * n, err_norms, slacks[r], q_norms,
                                               slacks[rows + r], slack_floor, max_candidates);
    free(slacks);
    return status;
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
        out[r] = decide_row(x + r * k, k, w, n, logits + r * n, norms, (float)(norm_of(x + r * k, k) * slack_scale),
                            norms, 0.0f, slack_floor, max_candidates);
}
