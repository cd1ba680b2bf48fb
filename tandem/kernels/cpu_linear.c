/* Small-batch linear for float32 activations and bfloat16 weights on x86-64 CPUs with AVX-512 or AVX2.

   out[m, n] = sum_k x[m, k] * wt[k, n] (+ bias[n]):  x [M, K] float32, wt [K, N] bfloat16 (the
   transposed weight; its rows `ldw` >= N apart, so it may be a column block of a wider matrix),
   bias [N] float32 or NULL, out [M, N] float32; x, bias and out contiguous.

   A decode or verify step multiplies a few rows by every weight once. Widening the weights to
   float32 and calling sgemm writes and re-reads them, and sgemm's small-M path is slower than a
   GEMV. Here each weight row of a block's columns is widened in registers (a bfloat16 is the top
   half of a float32) and multiplied into the accumulators of the block's rows, so it is read once
   per block of rows.

   A block walks down its columns, one weight row every `ldw` elements: a stride of kilobytes, a
   new page every row or two, where the hardware prefetchers stop. A step's weights come from the
   last-level cache or from memory (a model's layers together outgrow the core's own caches), so
   a block reads as wide a piece of each weight row as its registers hold, and prefetches the rows
   PREFETCH_ROWS ahead itself, into the core's L2 (its L1 keeps too few misses in flight for that
   distance: prefetched into L1, a verify's multiply-adds waited on memory rather than overlapping
   it). A block's last rows prefetch the next block's first, and a call's first block is primed
   before it starts, so no block begins on misses. Blocks of one row (decode, drafting) are
   ROW_VECTORS wide; blocks of several rows share the registers between their rows' accumulators
   (rows_block).

   Every out[m, n] is one fused multiply-add chain over k in order, whatever M is and however
   the rows and columns are blocked: a row's result does not depend on the batch it is in.

   Two builds of the same blocking, chosen at run time (`isas`): AVX-512 (32 registers of 16 floats) and AVX2 +
   FMA (16 registers of 8 floats: narrower blocks, at most four rows each, and tails loaded through a copy, as
   AVX2 has no masked 16-bit load). Their chains are the same, so both give the same bits. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "cpu_builds.h"

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_KERNEL 1
#include <immintrin.h> /* outside the target regions: each build's code calls the intrinsics of its own target */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")

#define MAX_BLOCK_ROWS 6 /* rows per block at most: MAX_BLOCK_ROWS * VECTORS accumulators of the 32 registers */
#define VECTORS 4        /* a block's width from four rows, in vectors of 16 outputs (fewer rows: rows_block) */
#define ROW_VECTORS 16   /* a block of one row's width */
#define PREFETCH_ROWS 32 /* how far ahead of its weight row a block prefetches */

static inline __attribute__((always_inline)) __m512 avx512_load_bf16(const uint16_t *p, __mmask16 mask) {
    __m256i half = mask == 0xFFFF ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The cache lines of `vectors` (<= max_vectors) vectors of a weight row into L2: a line holds two vectors'
   32 bfloat16. */
static inline __attribute__((always_inline)) void avx512_prefetch_row(const uint16_t *row, int vectors,
                                                                     int max_vectors) {
#pragma GCC unroll 16
    for (int v = 0; v < max_vectors; v += 2)
        if (v < vectors) _mm_prefetch((const char *)(row + 16 * v), _MM_HINT_T1);
}

/* rows (<= max_rows) rows of x times `vectors` (<= max_vectors) * 16 columns of wt, the last vector
   holding the columns in `tail`; `next` (NULL: none) is the next block's first column, `next_vectors`
   its width. Inlined with constants for max_rows and max_vectors, which size the accumulators, and for
   the full blocks' vectors, which then load unmasked. */
static inline __attribute__((always_inline)) void avx512_block(const float *x, int rows, int max_rows, int k_size,
                                                               const uint16_t *wt, int64_t ldw, int n_size,
                                                               int vectors, int max_vectors, __mmask16 tail,
                                                               const float *bias, float *out, const uint16_t *next,
                                                               int next_vectors) {
    __m512 acc[MAX_BLOCK_ROWS * ROW_VECTORS];
#pragma GCC unroll 16
    for (int i = 0; i < max_rows * max_vectors; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < k_size; k++) {
        const uint16_t *w_row = wt + k * ldw;
        if (k + PREFETCH_ROWS < k_size)
            avx512_prefetch_row(w_row + PREFETCH_ROWS * ldw, vectors, max_vectors);
        else if (next && k + PREFETCH_ROWS - k_size < k_size)
            avx512_prefetch_row(next + (k + PREFETCH_ROWS - k_size) * ldw, next_vectors, max_vectors);
        __m512 w[ROW_VECTORS];
#pragma GCC unroll 16
        for (int v = 0; v < max_vectors; v++)
            w[v] = v < vectors ? avx512_load_bf16(w_row + 16 * v, v == vectors - 1 ? tail : 0xFFFF)
                               : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int m = 0; m < max_rows; m++)
            if (m < rows) {
                __m512 xv = _mm512_set1_ps(x[(int64_t)m * k_size + k]);
#pragma GCC unroll 16
                for (int v = 0; v < max_vectors; v++)
                    if (v < vectors) acc[m * max_vectors + v] = _mm512_fmadd_ps(xv, w[v], acc[m * max_vectors + v]);
            }
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < vectors; v++) {
            __mmask16 mask = v == vectors - 1 ? tail : 0xFFFF;
            __m512 r = acc[m * max_vectors + v];
            if (bias) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, bias + 16 * v));
            _mm512_mask_storeu_ps(out + (int64_t)m * n_size + 16 * v, mask, r);
        }
}

/* The vectors of the block that starts with `columns` columns left: max_vectors, or fewer at the end. */
static inline int avx512_block_vectors(int columns, int max_vectors) {
    int vectors = (columns + 15) / 16;
    return vectors < max_vectors ? vectors : max_vectors;
}

/* Rows m0 .. m0 + rows - 1 (rows <= max_rows) over every column, in blocks of max_vectors vectors. */
static inline __attribute__((always_inline)) void avx512_column_blocks(const float *x, int rows, int max_rows,
                                                                       int k_size, const uint16_t *wt, int64_t ldw,
                                                                       int n_size, int max_vectors, const float *bias,
                                                                       float *out) {
    int width = 16 * max_vectors;
    for (int k = 0; k < PREFETCH_ROWS && k < k_size; k++)
        avx512_prefetch_row(wt + k * ldw, avx512_block_vectors(n_size, max_vectors), max_vectors);
    for (int n0 = 0; n0 < n_size; n0 += width) {
        const float *b = bias ? bias + n0 : NULL;
        int left = n_size - n0, next_left = left - width;
        const uint16_t *next = next_left > 0 ? wt + n0 + width : NULL;
        int next_vectors = avx512_block_vectors(next_left, max_vectors);
        if (left >= width) {
            avx512_block(x, rows, max_rows, k_size, wt + n0, ldw, n_size, max_vectors, max_vectors, 0xFFFF, b,
                         out + n0, next, next_vectors);
        } else {
            int vectors = avx512_block_vectors(left, max_vectors);
            int last = left - 16 * (vectors - 1); /* 1..16 columns */
            __mmask16 tail = (__mmask16)(last == 16 ? 0xFFFF : (1u << last) - 1);
            avx512_block(x, rows, max_rows, k_size, wt + n0, ldw, n_size, vectors, max_vectors, tail, b, out + n0,
                         NULL, 0);
        }
    }
}

/* Rows m0 .. m0 + rows - 1 as one block, as wide as their accumulators leave registers for: 16 vectors for one
   row, 8 for two, 5 for three, 4 from four to MAX_BLOCK_ROWS. */
static void avx512_rows_block(const float *x, int rows, int k_size, const uint16_t *wt, int64_t ldw, int n_size,
                              const float *bias, float *out) {
    switch (rows) {
    case 1: avx512_column_blocks(x, 1, 1, k_size, wt, ldw, n_size, ROW_VECTORS, bias, out); break;
    case 2: avx512_column_blocks(x, 2, 2, k_size, wt, ldw, n_size, ROW_VECTORS / 2, bias, out); break;
    case 3: avx512_column_blocks(x, 3, 3, k_size, wt, ldw, n_size, 5, bias, out); break;
    default: avx512_column_blocks(x, rows, MAX_BLOCK_ROWS, k_size, wt, ldw, n_size, VECTORS, bias, out);
    }
}

static void avx512_linear(const float *x, const uint16_t *wt, const float *bias, float *out, int m_size, int k_size,
                          int n_size, int64_t ldw) {
    int blocks = (m_size + MAX_BLOCK_ROWS - 1) / MAX_BLOCK_ROWS;
    int block_rows = (m_size + blocks - 1) / blocks; /* 8 rows: two blocks of 4, not 6 + 2 */
    for (int m0 = 0; m0 < m_size; m0 += block_rows) {
        int rows = m_size - m0 < block_rows ? m_size - m0 : block_rows;
        avx512_rows_block(x + (int64_t)m0 * k_size, rows, k_size, wt, ldw, n_size, bias, out + (int64_t)m0 * n_size);
    }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* The AVX2 blocks' widths in vectors of 8 outputs, by their rows (1 to AVX2_BLOCK_ROWS): each row's accumulators,
   its broadcast input and a weight vector within the 16 registers. */
#define AVX2_BLOCK_ROWS 4
static const int AVX2_VECTORS[AVX2_BLOCK_ROWS + 1] = {0, 12, 6, 4, 2};

/* 8 bfloat16 widened; `count` (1..8) of them read, the rest zero (a tail: AVX2 has no masked 16-bit load). */
static inline __attribute__((always_inline)) __m256 avx2_load_bf16(const uint16_t *p, int count) {
    __m128i half;
    if (count == 8) {
        half = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t copy[8] = {0};
        for (int i = 0; i < count; i++) copy[i] = p[i];
        half = _mm_loadu_si128((const __m128i *)copy);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline __m256i avx2_tail_mask(int count) { /* the first `count` (1..8) lanes */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The cache lines of `vectors` (<= max_vectors) vectors of a weight row into L2: a line holds four vectors' 32
   bfloat16. */
static inline __attribute__((always_inline)) void avx2_prefetch_row(const uint16_t *row, int vectors,
                                                                   int max_vectors) {
#pragma GCC unroll 12
    for (int v = 0; v < max_vectors; v += 4)
        if (v < vectors) _mm_prefetch((const char *)(row + 8 * v), _MM_HINT_T1);
}

/* avx512_block's AVX2 build: rows (<= max_rows) rows of x times `vectors` (<= max_vectors) * 8 columns of wt, the
   last vector holding `tail` (1..8) columns; `next` (NULL: none) the next block's first column. */
static inline __attribute__((always_inline)) void avx2_block(const float *x, int rows, int max_rows, int k_size,
                                                            const uint16_t *wt, int64_t ldw, int n_size, int vectors,
                                                            int max_vectors, int tail, const float *bias, float *out,
                                                            const uint16_t *next, int next_vectors) {
    __m256 acc[12];
#pragma GCC unroll 12
    for (int i = 0; i < max_rows * max_vectors; i++) acc[i] = _mm256_setzero_ps();
    for (int k = 0; k < k_size; k++) {
        const uint16_t *w_row = wt + k * ldw;
        if (k + PREFETCH_ROWS < k_size)
            avx2_prefetch_row(w_row + PREFETCH_ROWS * ldw, vectors, max_vectors);
        else if (next && k + PREFETCH_ROWS - k_size < k_size)
            avx2_prefetch_row(next + (k + PREFETCH_ROWS - k_size) * ldw, next_vectors, max_vectors);
        __m256 xv[AVX2_BLOCK_ROWS];
#pragma GCC unroll 4
        for (int m = 0; m < max_rows; m++)
            if (m < rows) xv[m] = _mm256_set1_ps(x[(int64_t)m * k_size + k]);
#pragma GCC unroll 12
        for (int v = 0; v < max_vectors; v++)
            if (v < vectors) {
                __m256 w = avx2_load_bf16(w_row + 8 * v, v == vectors - 1 ? tail : 8);
#pragma GCC unroll 4
                for (int m = 0; m < max_rows; m++)
                    if (m < rows) acc[m * max_vectors + v] = _mm256_fmadd_ps(xv[m], w, acc[m * max_vectors + v]);
            }
    }
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < vectors; v++) {
            __m256i mask = avx2_tail_mask(v == vectors - 1 ? tail : 8);
            __m256 r = acc[m * max_vectors + v];
            if (bias) r = _mm256_add_ps(r, _mm256_maskload_ps(bias + 8 * v, mask));
            _mm256_maskstore_ps(out + (int64_t)m * n_size + 8 * v, mask, r);
        }
}

static inline int avx2_block_vectors(int columns, int max_vectors) {
    int vectors = (columns + 7) / 8;
    return vectors < max_vectors ? vectors : max_vectors;
}

/* avx512_column_blocks' AVX2 build. */
static inline __attribute__((always_inline)) void avx2_column_blocks(const float *x, int rows, int max_rows,
                                                                    int k_size, const uint16_t *wt, int64_t ldw,
                                                                    int n_size, int max_vectors, const float *bias,
                                                                    float *out) {
    int width = 8 * max_vectors;
    for (int k = 0; k < PREFETCH_ROWS && k < k_size; k++)
        avx2_prefetch_row(wt + k * ldw, avx2_block_vectors(n_size, max_vectors), max_vectors);
    for (int n0 = 0; n0 < n_size; n0 += width) {
        const float *b = bias ? bias + n0 : NULL;
        int left = n_size - n0, next_left = left - width;
        const uint16_t *next = next_left > 0 ? wt + n0 + width : NULL;
        int next_vectors = avx2_block_vectors(next_left, max_vectors);
        if (left >= width) {
            avx2_block(x, rows, max_rows, k_size, wt + n0, ldw, n_size, max_vectors, max_vectors, 8, b, out + n0, next,
                       next_vectors);
        } else {
            int vectors = avx2_block_vectors(left, max_vectors);
            avx2_block(x, rows, max_rows, k_size, wt + n0, ldw, n_size, vectors, max_vectors, left - 8 * (vectors - 1),
                       b, out + n0, NULL, 0);
        }
    }
}

static void avx2_rows_block(const float *x, int rows, int k_size, const uint16_t *wt, int64_t ldw, int n_size,
                            const float *bias, float *out) {
    switch (rows) {
    case 1: avx2_column_blocks(x, 1, 1, k_size, wt, ldw, n_size, AVX2_VECTORS[1], bias, out); break;
    case 2: avx2_column_blocks(x, 2, 2, k_size, wt, ldw, n_size, AVX2_VECTORS[2], bias, out); break;
    case 3: avx2_column_blocks(x, 3, 3, k_size, wt, ldw, n_size, AVX2_VECTORS[3], bias, out); break;
    default: avx2_column_blocks(x, 4, 4, k_size, wt, ldw, n_size, AVX2_VECTORS[4], bias, out);
    }
}

static void avx2_linear(const float *x, const uint16_t *wt, const float *bias, float *out, int m_size, int k_size,
                        int n_size, int64_t ldw) {
    int blocks = (m_size + AVX2_BLOCK_ROWS - 1) / AVX2_BLOCK_ROWS;
    int block_rows = (m_size + blocks - 1) / blocks;
    for (int m0 = 0; m0 < m_size; m0 += block_rows) {
        int rows = m_size - m0 < block_rows ? m_size - m0 : block_rows;
        avx2_rows_block(x + (int64_t)m0 * k_size, rows, k_size, wt, ldw, n_size, bias, out + (int64_t)m0 * n_size);
    }
}
#pragma GCC pop_options
#endif

typedef void (*linear_fn)(const float *, const uint16_t *, const float *, float *, int, int, int, int64_t);

/* linear(x, wt, bias, out, m, k, n, ldw, isa): the tensors' data pointers (bias 0 for none), the sizes, the
   distance between wt's rows, and the build's index (one that `isas` lists). */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "linear takes 9 arguments (x, wt, bias, out, m, k, n, ldw, isa), got %zd",
                     nargs);
        return NULL;
    }
    void *ptr[4];
    long size[4];
    for (int i = 0; i < 4; i++) ptr[i] = PyLong_AsVoidPtr(args[i]);
    for (int i = 0; i < 4; i++) size[i] = PyLong_AsLong(args[4 + i]);
    long isa = PyLong_AsLong(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (size[0] < 0 || size[1] < 0 || size[2] < 0 || size[0] > INT32_MAX || size[1] > INT32_MAX || size[2] > INT32_MAX ||
        (size[1] > 1 && size[3] < size[2])) {
        PyErr_Format(PyExc_ValueError, "linear: sizes m=%ld k=%ld n=%ld ldw=%ld out of range", size[0], size[1], size[2],
                     size[3]);
        return NULL;
    }
    if (check_build("linear", isa) < 0) return NULL;
#ifdef HAVE_KERNEL
    linear_fn fn = isa == 0 ? avx512_linear : avx2_linear;
    Py_BEGIN_ALLOW_THREADS /* the grammar-mask worker runs meanwhile */
    fn(ptr[0], ptr[1], ptr[2], ptr[3], (int)size[0], (int)size[1], (int)size[2], size[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "linear: this build has no kernel (not x86-64 with GCC or Clang)");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"isas", isas, METH_NOARGS, "The builds this CPU runs, fastest first: 'avx512', 'avx2'."},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "linear(x, wt, bias, out, m, k, n, ldw, isa): out = x @ wt (+ bias), from data pointers, by build `isa`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_linear", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_linear(void) {
#if defined(__GNUC__) && defined(__x86_64__)
    __builtin_cpu_init();
    detect_builds(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl"));
#endif
    return PyModule_Create(&module);
}
