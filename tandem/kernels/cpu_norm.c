/* RMSNorm of float32 rows on the CPU, in portable C (no instruction-set extension asked for).

   out[r, d] = x[r, d] * (1 / sqrt(sum_d x[r, d]^2 / D + eps)) * w[d]:  x [R, D] float32 with rows `ldx` >= D
   apart (a column block of a wider matrix too), w [D] float32, out [R, D] float32 contiguous.

   A decode step of a small model normalises a row twice per layer, and torch's six ops for it (square, mean,
   add, rsqrt, two products) cost most of the norm's time in dispatch alone. The arithmetic is HF's
   LlamaRMSNorm's in float32 except the order of the sum of squares: LANES partial sums, lane l taking the
   elements d = l (mod LANES) in order, then folded in halves. That order depends on nothing but D, so a row's
   output does not depend on the other rows of its batch. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#define LANES 16 /* independent partial sums: the compiler keeps them in vector registers */

static void rms_norm(const float *x, int64_t ldx, const float *w, float *out, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *row = x + r * ldx;
        float *o = out + (int64_t)r * dim;
        float partial[LANES] = {0};
        int d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; l++) partial[l] += row[d + l] * row[d + l];
        for (int l = 0; d < dim; d++, l++) partial[l] += row[d] * row[d];
        for (int half = LANES / 2; half > 0; half /= 2)
            for (int l = 0; l < half; l++) partial[l] += partial[l + half];
        float scale = 1.0f / sqrtf(partial[0] / (float)dim + eps);
        for (d = 0; d < dim; d++) o[d] = row[d] * scale * w[d];
    }
}

/* rms_norm(x, w, out, rows, dim, ldx, eps): the tensors' data pointers, the sizes, the distance between x's rows
   and epsilon. Keeps the GIL: the work is shorter than handing it over and taking it back. */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "rms_norm takes 7 arguments (x, w, out, rows, dim, ldx, eps), got %zd", nargs);
        return NULL;
    }
    void *ptr[3];
    long size[3];
    for (int i = 0; i < 3; i++) ptr[i] = PyLong_AsVoidPtr(args[i]);
    for (int i = 0; i < 3; i++) size[i] = PyLong_AsLong(args[3 + i]);
    double eps = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (size[0] < 0 || size[1] < 1 || size[0] > INT32_MAX || size[1] > INT32_MAX || size[2] < size[1]) {
        PyErr_Format(PyExc_ValueError, "rms_norm: sizes rows=%ld dim=%ld ldx=%ld out of range", size[0], size[1],
                     size[2]);
        return NULL;
    }
    rms_norm(ptr[0], size[2], ptr[1], ptr[2], (int)size[0], (int)size[1], (float)eps);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, w, out, rows, dim, ldx, eps): out = RMSNorm(x) * w, from data pointers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_norm", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_norm(void) { return PyModule_Create(&module); }
