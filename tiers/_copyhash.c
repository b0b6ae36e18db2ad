/* kvtier.tiers._copyhash: copies into and out of the host pool (client/engine/copyin.py).

copy_hash(dst, src) -> int
    Copy the buffer src into the writable buffer dst (same length) and return the xxh3-64 of
    the bytes copied: chunk by chunk (CHUNK bytes), each chunk is hashed (XXH3 streaming,
    which reads it into the cache) and then copied from the cache, so the checksum costs no
    second pass over memory. Equal to xxhash.xxh3_64_intdigest(src) when nobody writes src
    meanwhile (a caller writing its own buffer during its put gets a checksum that its slot's
    bytes may not match: the block then fails its verification later, a miss).
copy(dst, src)
    The same copy, no checksum (a get's copy out of the pool).

A copy of at least STREAM_MIN bytes uses non-temporal stores where the CPU has SSE2 (the
destination bypasses the cache: no read of each destination line before it is written,
which the pool's 4 KiB shared-memory pages make dear); smaller ones and other CPUs memcpy.
Both release the GIL. Where GCC builds for x86-64, copy_hash runs the same loop compiled for
AVX2 (tiers/_copyhash_avx2.c) when the CPU and the OS have it (__builtin_cpu_supports checks
both: CPUID and XGETBV's YMM state); the AVX2 constant says which loop runs. Setting
KVTIER_COPYHASH_BASELINE=1 in the environment before the import forces the baseline loop
(tests check both; a CPU whose AVX2 path is suspect). xxhash.h is vendored (tiers/xxhash/,
BSD 2-clause, its LICENSE beside it).

dst and src must not overlap (ValueError: the chunked hash-then-copy would hash bytes it had
already overwritten); both must be C-contiguous (BufferError/ValueError from the exporter),
dst writable (TypeError); lengths are in bytes, whatever the item size.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KVTIER_HAVE_AVX2 1 /* tiers/_copyhash_avx2.c: the same loop built for AVX2 */
#endif

#include "_copyhash_impl.h"

#if defined(KVTIER_HAVE_AVX2)
uint64_t kvtier_copy_hash_avx2(char *d, const char *s, size_t n);
#endif

static int get_buffers(PyObject *args, Py_buffer *dst, Py_buffer *src) {
    if (!PyArg_ParseTuple(args, "w*y*", dst, src))
        return -1;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes but src is %zd", dst->len, src->len);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    if (dst->len > 0 && (uintptr_t)dst->buf < (uintptr_t)src->buf + (size_t)src->len &&
        (uintptr_t)src->buf < (uintptr_t)dst->buf + (size_t)dst->len) {
        PyErr_SetString(PyExc_ValueError, "dst and src overlap");
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

static int have_avx2;

static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    uint64_t h;
    (void)self;
    if (get_buffers(args, &dst, &src) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
#if defined(KVTIER_HAVE_AVX2)
    if (have_avx2)
        h = kvtier_copy_hash_avx2((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    else
#endif
        h = copy_hash_impl((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

static PyObject *copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    (void)self;
    if (get_buffers(args, &dst, &src) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    {
        size_t n = (size_t)src.len;
        int stream = n >= STREAM_MIN;
        copy_bytes((char *)dst.buf, (const char *)src.buf, n, stream);
        if (stream)
            fence();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_hash", copy_hash, METH_VARARGS, "copy_hash(dst, src) -> xxh3-64 of the bytes copied"},
    {"copy", copy, METH_VARARGS, "copy(dst, src): copy src into dst"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__copyhash(void) {
    PyObject *m = PyModule_Create(&module);
#if defined(KVTIER_HAVE_AVX2)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") != 0;
    {
        const char *base = getenv("KVTIER_COPYHASH_BASELINE"); /* forces the baseline loop */
        if (base != NULL && base[0] != '\0' && strcmp(base, "0") != 0)
            have_avx2 = 0;
    }
#endif
    if (m != NULL && (PyModule_AddIntConstant(m, "CHUNK_BYTES", (long)CHUNK) < 0 ||
                      PyModule_AddIntConstant(m, "AVX2", have_avx2) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
