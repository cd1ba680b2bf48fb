/* Paged attention of float32 queries on x86-64 CPUs with AVX-512 or AVX2: each row's keys and values read through
   its block table, as tandem/kernels/paged_attention.py's Triton kernels read them on a GPU (the same contract).

   For row b, query i and query head h (key/value head h / (nh / nkv): GQA; MLA's one latent head for every
   query head):

       out[b, i, h] = softmax_j(scale * q[b, i, h] . K_j) @ V_j   over key_start <= j < key_end, j <= pos[b, i]

   position j's entry being entry (j - key_offset) % block_size of block tables[b, (j - key_offset) / block_size]
   of the pools (any strides between blocks, entries and heads; a pool's last axis contiguous).

   A decode or verify step of a small model attends over a few hundred keys per row, where the torch path's
   gather, transposes and sdpa call cost more in dispatch than in arithmetic. Here a row's entries are found once
   by walking its blocks; a score is a query's and a key's products summed in 16 lanes (the query held in
   registers), 16 keys' lanes then added across in one tree; the scores are exponentiated against their maximum,
   and each output vector of 16 values sums the keys' values with those weights, in key order, in one register,
   then divides by the weights' sum: float32 throughout. The (query, head) pairs that read one key/value head sum
   their values side by side, each value vector loaded once for them all. The order of every sum is fixed by the
   sizes alone, so a query's result depends on nothing but its own keys: neither the other rows nor the number of
   queries in its row change it.

   The walk over rows, tiles of pairs and keys is shared; its three stages per tile (scores, weights, value sums:
   `Build`) have an AVX-512 build (vectors of 16, 32 registers) and an AVX2 + FMA build (vectors of 8, 16
   registers: the same stages in 8 lanes, fewer query vectors and accumulators held at once), chosen per call. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "cpu_builds.h"
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_KERNEL 1
#include <immintrin.h> /* outside the target regions: each build calls the intrinsics of its own target */

#define KEYS 16      /* the unit the scores' rows and key offsets are padded to: whole vectors in either build */
#define MAX_PAIRS 16 /* (query, head) pairs scored per pass over a head's keys: the scores' scratch */

typedef struct {
    const float *base;
    int64_t block, entry, head; /* strides, in floats */
} Pool;

typedef struct {
    const float *q;
    int64_t q_row, q_query, q_head;
    Pool keys, values;
    const int64_t *tables, *positions;
    int64_t table_row, position_row;
    float *out;
    int rows, queries, heads, kv_heads, key_dim, value_dim, block_size;
    int64_t key_start, key_end, key_offset;
    float scale;
} Attention;

/* A build's three stages for a tile of (query, head) pairs of row b over key/value head kv: their scores over the
   row's first `seen` keys (`keys`: their offsets), a pair's scores turned into its softmax's unnormalised weights
   (returning the inverse of their sum), and the pairs' outputs from their weights. */
typedef struct {
    void (*score_pairs)(const Attention *a, int b, int kv, const int *queries, const int *heads, int pairs,
                        const int64_t *keys, int64_t seen, int64_t padded, float *scores);
    float (*weigh)(const Attention *a, int64_t num_keys, float *scores);
    void (*weigh_values)(const Attention *a, int kv, const int64_t *values, int pairs, const int64_t *num_keys,
                         const float *weights, int64_t padded, const float *inverse, float *const *outs);
} Build;

/* offsets[j]: where position key_start + j's entry of head 0 lies in `pool`, in floats from its base, for j < count
   (padded to a whole vector with the last one), walking the row's blocks: no division per key. */
static void row_offsets(const Pool *pool, const int64_t *table, const Attention *a, int64_t count, int64_t *offsets) {
    int64_t rel = a->key_start - a->key_offset, block = rel / a->block_size, entry = rel % a->block_size;
    for (int64_t j = 0; j < count; j++) {
        offsets[j] = table[block] * pool->block + entry * pool->entry;
        if (++entry == a->block_size) entry = 0, block++;
    }
    for (int64_t j = count; j % KEYS; j++) offsets[j] = offsets[count - 1];
}

/* How many keys a query at `position` sees: those from key_start up to its own position, within the window. */
static inline int64_t keys_seen(const Attention *a, int64_t position) {
    return (position + 1 < a->key_end ? position + 1 : a->key_end) - a->key_start;
}

/* 0, or -1 when the scratch could not be allocated. */
static int attend(const Attention *a, const Build *build) {
    int group = a->heads / a->kv_heads;
    int64_t window = a->key_end - a->key_start, padded = (window + KEYS - 1) / KEYS * KEYS;
    size_t head_out = (size_t)a->value_dim;
    if (window <= 0) {
        memset(a->out, 0, sizeof(float) * (size_t)a->rows * a->queries * a->heads * head_out);
        return 0;
    }
    /* scratch: the row's key and value offsets, and the scores of a tile of pairs */
    int64_t *keys = malloc(sizeof(int64_t) * 2 * padded + sizeof(float) * MAX_PAIRS * padded);
    if (keys == NULL) return -1;
    int64_t *values = keys + padded;
    float *scores = (float *)(values + padded);
    for (int b = 0; b < a->rows; b++) {
        const int64_t *table = a->tables + b * a->table_row, *positions = a->positions + b * a->position_row;
        int64_t seen = 0; /* the most keys a query of the row sees */
        for (int i = 0; i < a->queries; i++) {
            int64_t n = keys_seen(a, positions[i]);
            seen = n > seen ? n : seen;
        }
        if (seen > 0) {
            row_offsets(&a->keys, table, a, seen, keys);
            row_offsets(&a->values, table, a, seen, values);
        }
        int queries[MAX_PAIRS], heads[MAX_PAIRS];
        int64_t counts[MAX_PAIRS];
        float inverse[MAX_PAIRS], *outs[MAX_PAIRS];
        for (int kv = 0; kv < a->kv_heads; kv++)
            for (int first = 0; first < a->queries * group; first += MAX_PAIRS) { /* pairs query-major */
                int pairs = a->queries * group - first < MAX_PAIRS ? a->queries * group - first : MAX_PAIRS;
                for (int p = 0; p < pairs; p++)
                    queries[p] = (first + p) / group, heads[p] = kv * group + (first + p) % group;
                if (seen > 0) build->score_pairs(a, b, kv, queries, heads, pairs, keys, seen, padded, scores);
                int seeing = 0; /* the tile's pairs that see a key, moved to its front */
                for (int p = 0; p < pairs; p++) {
                    int64_t num_keys = keys_seen(a, positions[queries[p]]);
                    float *out = a->out + (((int64_t)b * a->queries + queries[p]) * a->heads + heads[p]) * head_out;
                    if (num_keys <= 0) { /* sees no key: zeros (a padding query's output is dropped anyway) */
                        memset(out, 0, sizeof(float) * head_out);
                        continue;
                    }
                    if (seeing < p) memcpy(scores + seeing * padded, scores + p * padded, sizeof(float) * num_keys);
                    counts[seeing] = num_keys, outs[seeing] = out;
                    inverse[seeing] = build->weigh(a, num_keys, scores + seeing * padded);
                    seeing++;
                }
                if (seeing) build->weigh_values(a, kv, values, seeing, counts, scores, padded, inverse, outs);
            }
    }
    free(keys);
    return 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

#define VALUE_VECTORS 4 /* output vectors of 16 values a pass over the keys sums at once: independent chains */
#define VALUE_REGISTERS 16 /* the accumulators of a group of pairs' value sums: pairs x vectors */
#define MAX_QUERY_VECTORS 8 /* a query's vectors of 16 entries held in registers while it is scored (head_dim 128) */

/* e^x for x <= 0, within 2 ulps: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by Cephes' expf polynomial, 2^n built in
   the exponent bits; 0 below -87 (under float32's smallest normal). */
static inline __m512 avx512_exp_nonpositive(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_maskz_mov_ps(keep, x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(two_n)));
}

/* r[k] = the sum of v[k]'s 16 lanes, for 16 vectors: pairs of lanes added in one fixed tree of shuffles, which
   the 16 vectors share where 16 separate reductions would each run their own. */
static inline __m512 avx512_sum_lanes16(const __m512 *v) {
    __m512 t[8], u[4], x[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One pair's scores over its first `seen` keys (`keys`: their offsets from `base`): scores[j], unscaled. Each is its
   products summed in 16 lanes (entries d, d + 16, ... in order in lane d % 16), then across the lanes, 16 keys at a
   time. The query's vectors of 16 entries are held in registers, max_vectors (a constant: the products unroll) at a
   time, the keys' lane sums carried from one such part of the query to the next. */
static inline __attribute__((always_inline)) void avx512_score_pair(const float *q, const float *base,
                                                                    const int64_t *keys, int64_t seen, int vectors,
                                                                    int max_vectors, __mmask16 tail, float *scores) {
    for (int64_t j0 = 0; j0 < seen; j0 += KEYS) {
        __m512 acc[KEYS];
#pragma GCC unroll 16
        for (int k = 0; k < KEYS; k++) acc[k] = _mm512_setzero_ps();
        for (int v0 = 0; v0 < vectors; v0 += max_vectors) {
            __m512 q_v[MAX_QUERY_VECTORS];
            __mmask16 m[MAX_QUERY_VECTORS]; /* each vector's entries: all 16 but in the query's last */
#pragma GCC unroll 8
            for (int v = 0; v < max_vectors; v++)
                if (v0 + v < vectors) {
                    m[v] = v0 + v == vectors - 1 ? tail : 0xFFFF;
                    q_v[v] = _mm512_maskz_loadu_ps(m[v], q + 16 * (v0 + v));
                }
#pragma GCC unroll 16
            for (int k = 0; k < KEYS; k++) {
                const float *key = base + keys[j0 + k] + 16 * v0;
#pragma GCC unroll 8
                for (int v = 0; v < max_vectors; v++)
                    if (v0 + v < vectors)
                        acc[k] = _mm512_fmadd_ps(q_v[v], _mm512_maskz_loadu_ps(m[v], key + 16 * v), acc[k]);
            }
        }
        _mm512_storeu_ps(scores + j0, avx512_sum_lanes16(acc));
    }
}

/* The scores of `pairs` (query, head) pairs of row b over its first `seen` keys of head kv (queries[p], heads[p]:
   the pair's query and head; the row's key offsets in `keys`): scores[p * padded + j], unscaled (score_pair's). */
static void avx512_score_pairs(const Attention *a, int b, int kv, const int *queries, const int *heads, int pairs,
                               const int64_t *keys, int64_t seen, int64_t padded, float *scores) {
    const float *base = a->keys.base + kv * a->keys.head;
    int vectors = (a->key_dim + 15) / 16, last = a->key_dim - 16 * (vectors - 1);
    __mmask16 tail = (__mmask16)(last == 16 ? 0xFFFF : (1u << last) - 1);
    for (int p = 0; p < pairs; p++) {
        const float *q = a->q + b * a->q_row + queries[p] * a->q_query + heads[p] * a->q_head;
        float *row = scores + p * padded;
        switch (vectors) { /* the usual head sizes, each its own unrolled loop; larger ones (MLA's latent) in parts */
        case 1: avx512_score_pair(q, base, keys, seen, 1, 1, tail, row); break;
        case 2: avx512_score_pair(q, base, keys, seen, 2, 2, tail, row); break;
        case 3: avx512_score_pair(q, base, keys, seen, 3, 3, tail, row); break;
        case 4: avx512_score_pair(q, base, keys, seen, 4, 4, tail, row); break;
        case 5: avx512_score_pair(q, base, keys, seen, 5, 5, tail, row); break;
        case 6: avx512_score_pair(q, base, keys, seen, 6, 6, tail, row); break;
        case 7: avx512_score_pair(q, base, keys, seen, 7, 7, tail, row); break;
        case 8: avx512_score_pair(q, base, keys, seen, 8, 8, tail, row); break;
        default: avx512_score_pair(q, base, keys, seen, vectors, MAX_QUERY_VECTORS, tail, row);
        }
    }
}

/* One pair's `scores` row over its first num_keys keys turned into its softmax's weights, unnormalised (e^(scale *
   score - their maximum), in place); returns the inverse of their sum. */
static float avx512_weigh(const Attention *a, int64_t num_keys, float *scores) {
    __m512 scale = _mm512_set1_ps(a->scale), top = _mm512_set1_ps(-INFINITY);
    int64_t whole = num_keys / KEYS * KEYS;
    __mmask16 tail = (__mmask16)((1u << (num_keys - whole)) - 1);
    for (int64_t j = 0; j < num_keys; j += KEYS) {
        __mmask16 m = j < whole ? 0xFFFF : tail;
        top = _mm512_mask_max_ps(top, m, top, _mm512_mul_ps(scale, _mm512_loadu_ps(scores + j)));
    }
    __m512 top_all = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sums = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; j += KEYS) {
        __mmask16 m = j < whole ? 0xFFFF : tail;
        __m512 w = avx512_exp_nonpositive(_mm512_fmsub_ps(scale, _mm512_loadu_ps(scores + j), top_all));
        w = _mm512_maskz_mov_ps(m, w);
        _mm512_storeu_ps(scores + j, w);
        sums = _mm512_add_ps(sums, w);
    }
    return 1.0f / _mm512_reduce_add_ps(sums);
}

/* Pairs p < pairs (<= max_pairs) of a tile, over value columns d0 .. d0 + 16 * vectors - 1 (vectors <= max_vectors):
   out_p = inverse[p] * sum_j weights[p][j] V_j over the pair's first num_keys[p] keys, one register per pair and
   vector summing the keys in order (the pairs' chains run side by side, each value vector loaded once for all).
   Inlined with constant maxima, which keep the accumulators in registers. */
static inline __attribute__((always_inline)) void avx512_sum_values(const Attention *a, const float *base,
                                                                    const int64_t *values, int pairs, int max_pairs,
                                                                    const int64_t *num_keys, const float *weights,
                                                                    int64_t padded, const float *inverse, int d0,
                                                                    int vectors, int max_vectors, float *const *outs) {
    __mmask16 m[VALUE_VECTORS];
    __m512 acc[VALUE_REGISTERS];
    int64_t all = num_keys[0], most = num_keys[0]; /* keys every pair sees, and the most any sees */
    for (int p = 1; p < pairs; p++) {
        all = num_keys[p] < all ? num_keys[p] : all;
        most = num_keys[p] > most ? num_keys[p] : most;
    }
#pragma GCC unroll 4
    for (int v = 0; v < max_vectors; v++) {
        int left = a->value_dim - d0 - 16 * v;
        m[v] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
#pragma GCC unroll 16
    for (int i = 0; i < max_pairs * max_vectors; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < most; j++) {
        const float *value = base + values[j] + d0;
        __m512 v_j[VALUE_VECTORS];
#pragma GCC unroll 4
        for (int v = 0; v < max_vectors; v++)
            if (v < vectors) v_j[v] = _mm512_maskz_loadu_ps(m[v], value + 16 * v);
#pragma GCC unroll 16
        for (int p = 0; p < max_pairs; p++)
            if (p < pairs && (j < all || j < num_keys[p])) {
                __m512 w = _mm512_set1_ps(weights[p * padded + j]);
#pragma GCC unroll 4
                for (int v = 0; v < max_vectors; v++)
                    if (v < vectors) acc[p * max_vectors + v] = _mm512_fmadd_ps(w, v_j[v], acc[p * max_vectors + v]);
            }
    }
#pragma GCC unroll 16
    for (int p = 0; p < max_pairs; p++)
        if (p < pairs)
            for (int v = 0; v < vectors; v++)
                _mm512_mask_storeu_ps(outs[p] + d0 + 16 * v, m[v],
                                      _mm512_mul_ps(acc[p * max_vectors + v], _mm512_set1_ps(inverse[p])));
}

/* The outputs of a tile's pairs (num_keys[p] >= 1 each) from their weights (`weigh`d scores rows, `padded` apart),
   for head kv: out_p [value_dim]. */
static void avx512_weigh_values(const Attention *a, int kv, const int64_t *values, int pairs, const int64_t *num_keys,
                                const float *weights, int64_t padded, const float *inverse, float *const *outs) {
    const float *base = a->values.base + kv * a->values.head;
    for (int d0 = 0; d0 < a->value_dim; d0 += 16 * VALUE_VECTORS) {
        int vectors = (a->value_dim - d0 + 15) / 16;
        vectors = vectors < VALUE_VECTORS ? vectors : VALUE_VECTORS;
        int group = VALUE_REGISTERS / (vectors == 3 ? 4 : vectors); /* pairs whose accumulators fill them */
        for (int p0 = 0; p0 < pairs; p0 += group) {
            int g = pairs - p0 < group ? pairs - p0 : group;
            const int64_t *n = num_keys + p0;
            const float *w = weights + p0 * padded;
            if (vectors == 1)
                avx512_sum_values(a, base, values, g, VALUE_REGISTERS, n, w, padded, inverse + p0, d0, 1, 1, outs + p0);
            else if (vectors == 2)
                avx512_sum_values(a, base, values, g, VALUE_REGISTERS / 2, n, w, padded, inverse + p0, d0, 2, 2,
                                  outs + p0);
            else
                avx512_sum_values(a, base, values, g, VALUE_REGISTERS / 4, n, w, padded, inverse + p0, d0, vectors, 4,
                                  outs + p0);
        }
    }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* The AVX2 + FMA build: the same stages in vectors of 8 floats and 16 registers, so scores 8 keys at a time, a
   query's vectors held 4 at a time, and 8 accumulators of value sums; its sums run in 8 lanes (the AVX-512
   build's in 16), so the two builds round differently, each in an order fixed by the sizes alone. */
#define AVX2_KEYS 8            /* keys per vector of scores */
#define AVX2_QUERY_VECTORS 4   /* a query's vectors of 8 held while it is scored: with the 8 keys' sums, 12 */
#define AVX2_VALUE_VECTORS 4   /* output vectors of 8 values a pass over the keys sums at once */
#define AVX2_VALUE_REGISTERS 8 /* a group of pairs' value sums: with 4 value vectors and a weight, 13 */

static inline __m256i avx2_lanes(int64_t count) { /* the first `count` lanes (none for count <= 0, all from 8) */
    int c = count < 0 ? 0 : count > 8 ? 8 : (int)count;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) __m256 avx2_load(const float *p, int count) { /* zeros past count */
    return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, avx2_lanes(count));
}

/* avx512_exp_nonpositive's 8 lanes. */
static inline __m256 avx2_exp_nonpositive(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_and_ps(x, keep);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), keep);
}

/* r[k] = the sum of v[k]'s 8 lanes, for 8 vectors, in one fixed tree (avx512_sum_lanes16's). */
static inline __m256 avx2_sum_lanes8(const __m256 *v) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

static inline float avx2_max_lanes(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float avx2_add_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* avx512_score_pair in 8 lanes: the query's last vector holds `tail` (1..8) entries. */
static inline __attribute__((always_inline)) void avx2_score_pair(const float *q, const float *base,
                                                                 const int64_t *keys, int64_t seen, int vectors,
                                                                 int max_vectors, int tail, float *scores) {
    for (int64_t j0 = 0; j0 < seen; j0 += AVX2_KEYS) {
        __m256 acc[AVX2_KEYS];
#pragma GCC unroll 8
        for (int k = 0; k < AVX2_KEYS; k++) acc[k] = _mm256_setzero_ps();
        for (int v0 = 0; v0 < vectors; v0 += max_vectors) {
            __m256 q_v[AVX2_QUERY_VECTORS];
            int n[AVX2_QUERY_VECTORS]; /* each vector's entries: 8 but in the query's last */
#pragma GCC unroll 4
            for (int v = 0; v < max_vectors; v++)
                if (v0 + v < vectors) {
                    n[v] = v0 + v == vectors - 1 ? tail : 8;
                    q_v[v] = avx2_load(q + 8 * (v0 + v), n[v]);
                }
#pragma GCC unroll 8
            for (int k = 0; k < AVX2_KEYS; k++) {
                const float *key = base + keys[j0 + k] + 8 * v0;
#pragma GCC unroll 4
                for (int v = 0; v < max_vectors; v++)
                    if (v0 + v < vectors) acc[k] = _mm256_fmadd_ps(q_v[v], avx2_load(key + 8 * v, n[v]), acc[k]);
            }
        }
        _mm256_storeu_ps(scores + j0, avx2_sum_lanes8(acc));
    }
}

static void avx2_score_pairs(const Attention *a, int b, int kv, const int *queries, const int *heads, int pairs,
                             const int64_t *keys, int64_t seen, int64_t padded, float *scores) {
    const float *base = a->keys.base + kv * a->keys.head;
    int vectors = (a->key_dim + 7) / 8, tail = a->key_dim - 8 * (vectors - 1);
    for (int p = 0; p < pairs; p++) {
        const float *q = a->q + b * a->q_row + queries[p] * a->q_query + heads[p] * a->q_head;
        float *row = scores + p * padded;
        switch (vectors) { /* head sizes up to 32, each its own unrolled loop; larger ones in parts */
        case 1: avx2_score_pair(q, base, keys, seen, 1, 1, tail, row); break;
        case 2: avx2_score_pair(q, base, keys, seen, 2, 2, tail, row); break;
        case 3: avx2_score_pair(q, base, keys, seen, 3, 3, tail, row); break;
        case 4: avx2_score_pair(q, base, keys, seen, 4, 4, tail, row); break;
        default: avx2_score_pair(q, base, keys, seen, vectors, AVX2_QUERY_VECTORS, tail, row);
        }
    }
}

static float avx2_weigh(const Attention *a, int64_t num_keys, float *scores) {
    __m256 scale = _mm256_set1_ps(a->scale), none = _mm256_set1_ps(-INFINITY), top = none;
    for (int64_t j = 0; j < num_keys; j += AVX2_KEYS) {
        __m256 s = _mm256_mul_ps(scale, _mm256_loadu_ps(scores + j));
        top = _mm256_max_ps(top, _mm256_blendv_ps(none, s, _mm256_castsi256_ps(avx2_lanes(num_keys - j))));
    }
    __m256 top_all = _mm256_set1_ps(avx2_max_lanes(top)), sums = _mm256_setzero_ps();
    for (int64_t j = 0; j < num_keys; j += AVX2_KEYS) {
        __m256 w = avx2_exp_nonpositive(_mm256_fmsub_ps(scale, _mm256_loadu_ps(scores + j), top_all));
        w = _mm256_and_ps(w, _mm256_castsi256_ps(avx2_lanes(num_keys - j)));
        _mm256_storeu_ps(scores + j, w);
        sums = _mm256_add_ps(sums, w);
    }
    return 1.0f / avx2_add_lanes(sums);
}

/* avx512_sum_values in 8 lanes. */
static inline __attribute__((always_inline)) void avx2_sum_values(const Attention *a, const float *base,
                                                                 const int64_t *values, int pairs, int max_pairs,
                                                                 const int64_t *num_keys, const float *weights,
                                                                 int64_t padded, const float *inverse, int d0,
                                                                 int vectors, int max_vectors, float *const *outs) {
    int n[AVX2_VALUE_VECTORS];
    __m256 acc[AVX2_VALUE_REGISTERS];
    int64_t all = num_keys[0], most = num_keys[0];
    for (int p = 1; p < pairs; p++) {
        all = num_keys[p] < all ? num_keys[p] : all;
        most = num_keys[p] > most ? num_keys[p] : most;
    }
#pragma GCC unroll 4
    for (int v = 0; v < max_vectors; v++) n[v] = a->value_dim - d0 - 8 * v;
#pragma GCC unroll 8
    for (int i = 0; i < max_pairs * max_vectors; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < most; j++) {
        const float *value = base + values[j] + d0;
        __m256 v_j[AVX2_VALUE_VECTORS];
#pragma GCC unroll 4
        for (int v = 0; v < max_vectors; v++)
            if (v < vectors) v_j[v] = avx2_load(value + 8 * v, n[v]);
#pragma GCC unroll 8
        for (int p = 0; p < max_pairs; p++)
            if (p < pairs && (j < all || j < num_keys[p])) {
                __m256 w = _mm256_set1_ps(weights[p * padded + j]);
#pragma GCC unroll 4
                for (int v = 0; v < max_vectors; v++)
                    if (v < vectors) acc[p * max_vectors + v] = _mm256_fmadd_ps(w, v_j[v], acc[p * max_vectors + v]);
            }
    }
#pragma GCC unroll 8
    for (int p = 0; p < max_pairs; p++)
        if (p < pairs)
            for (int v = 0; v < vectors; v++)
                _mm256_maskstore_ps(outs[p] + d0 + 8 * v, avx2_lanes(n[v]),
                                    _mm256_mul_ps(acc[p * max_vectors + v], _mm256_set1_ps(inverse[p])));
}

static void avx2_weigh_values(const Attention *a, int kv, const int64_t *values, int pairs, const int64_t *num_keys,
                              const float *weights, int64_t padded, const float *inverse, float *const *outs) {
    const float *base = a->values.base + kv * a->values.head;
    for (int d0 = 0; d0 < a->value_dim; d0 += 8 * AVX2_VALUE_VECTORS) {
        int vectors = (a->value_dim - d0 + 7) / 8;
        vectors = vectors < AVX2_VALUE_VECTORS ? vectors : AVX2_VALUE_VECTORS;
        int group = AVX2_VALUE_REGISTERS / (vectors == 3 ? 4 : vectors);
        for (int p0 = 0; p0 < pairs; p0 += group) {
            int g = pairs - p0 < group ? pairs - p0 : group;
            const int64_t *n = num_keys + p0;
            const float *w = weights + p0 * padded;
            if (vectors == 1)
                avx2_sum_values(a, base, values, g, AVX2_VALUE_REGISTERS, n, w, padded, inverse + p0, d0, 1, 1,
                                outs + p0);
            else if (vectors == 2)
                avx2_sum_values(a, base, values, g, AVX2_VALUE_REGISTERS / 2, n, w, padded, inverse + p0, d0, 2, 2,
                                outs + p0);
            else
                avx2_sum_values(a, base, values, g, AVX2_VALUE_REGISTERS / 4, n, w, padded, inverse + p0, d0, vectors,
                                4, outs + p0);
        }
    }
}
#pragma GCC pop_options

static const Build BUILDS[] = {
    {avx512_score_pairs, avx512_weigh, avx512_weigh_values},
    {avx2_score_pairs, avx2_weigh, avx2_weigh_values},
};
#endif

/* paged_attention(q, k, v, tables, positions, out, 3 + 3 + 3 strides of q and the pools, the tables' and positions'
   row strides, rows, queries, heads, kv_heads, key_dim, value_dim, block_size, key_start, key_end, key_offset,
   scale, build): tandem/kernels/cpu_attention.py checks the shapes; here the sizes the loops rely on, and that
   this CPU runs the build (its index in ("avx512", "avx2")). */
static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 29) {
        PyErr_Format(PyExc_TypeError, "paged_attention takes 29 arguments, got %zd", nargs);
        return NULL;
    }
    void *ptr[6];
    long long n[21];
    for (int i = 0; i < 6; i++) ptr[i] = PyLong_AsVoidPtr(args[i]);
    for (int i = 0; i < 21; i++) n[i] = PyLong_AsLongLong(args[6 + i]);
    double scale = PyFloat_AsDouble(args[27]);
    long isa = PyLong_AsLong(args[28]);
    if (PyErr_Occurred()) return NULL;
    if (check_build("paged_attention", isa) < 0) return NULL;
#ifdef HAVE_KERNEL
    Attention a = {
        .q = ptr[0], .keys = {ptr[1], n[3], n[4], n[5]}, .values = {ptr[2], n[6], n[7], n[8]},
        .tables = ptr[3], .positions = ptr[4], .out = ptr[5],
        .q_row = n[0], .q_query = n[1], .q_head = n[2], .table_row = n[9], .position_row = n[10],
        .rows = (int)n[11], .queries = (int)n[12], .heads = (int)n[13], .kv_heads = (int)n[14],
        .key_dim = (int)n[15], .value_dim = (int)n[16], .block_size = (int)n[17],
        .key_start = n[18], .key_end = n[19], .key_offset = n[20], .scale = (float)scale,
    };
    if (a.rows < 0 || a.queries < 0 || a.kv_heads < 1 || a.heads < a.kv_heads || a.heads % a.kv_heads ||
        a.key_dim < 1 || a.value_dim < 1 || a.block_size < 1 || a.key_start < a.key_offset) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: sizes out of range");
        return NULL;
    }
    if (attend(&a, &BUILDS[isa]) != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "paged_attention: this build has no kernel (not x86-64 with GCC or Clang)");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"isas", isas, METH_NOARGS, "The builds this CPU runs, fastest first: 'avx512', 'avx2'."},
    {"paged_attention", (PyCFunction)(void (*)(void))py_paged_attention, METH_FASTCALL,
     "paged_attention(q, k, v, tables, positions, out, 21 strides and sizes, scale, build): out = attention, in "
     "place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_attention(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    detect_builds(__builtin_cpu_supports("avx512f"));
#endif
    return PyModule_Create(&module);
}
