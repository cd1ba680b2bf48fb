/* The x86-64 builds of the CPU kernels (cpu_linear.c, cpu_attention.c), by the index their entry points take, and
   which of them this CPU runs: set once at import (`detect_builds`), listed to Python by `isas()`. */

#ifndef TANDEM_CPU_BUILDS_H
#define TANDEM_CPU_BUILDS_H

#include <Python.h>

#define NUM_ISAS 2
static const char *const ISA_NAMES[NUM_ISAS] = {"avx512", "avx2"};
static int RUNS[NUM_ISAS];

/* RUNS from the CPU's features (after __builtin_cpu_init): the AVX-512 build needs `avx512` (the kernel's own
   subsets of AVX-512, checked by the caller) and FMA, the AVX2 build AVX2 and FMA. */
static void detect_builds(int avx512) {
#if defined(__GNUC__) && defined(__x86_64__)
    int fma = __builtin_cpu_supports("fma");
    RUNS[0] = avx512 && fma;
    RUNS[1] = __builtin_cpu_supports("avx2") && fma;
#else
    (void)avx512;
#endif
}

/* isas(): the names of the builds this CPU runs, fastest first. */
static PyObject *isas(PyObject *self, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (int isa = 0; names && isa < NUM_ISAS; isa++) {
        if (!RUNS[isa]) continue;
        PyObject *name = PyUnicode_FromString(ISA_NAMES[isa]);
        if (!name || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

/* 0 when this CPU runs build `isa`, else -1 with a ValueError naming `kernel`. */
static int check_build(const char *kernel, long isa) {
    if (isa >= 0 && isa < NUM_ISAS && RUNS[isa]) return 0;
    PyErr_Format(PyExc_ValueError, "%s: build %ld is not one this CPU runs (see isas())", kernel, isa);
    return -1;
}

#endif
