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
Both release the GIL. xxhash.h is vendored (tiers/xxhash/, BSD 2-clause, its LICENSE beside it).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash/xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define CHUNK ((size_t)256 * 1024)
#define STREAM_MIN ((size_t)256 * 1024)

static void copy_bytes(char *dst, const char *src, size_t n, int stream) {
#if defined(__SSE2__)
    if (stream) {
        size_t i = (16 - ((uintptr_t)dst & 15)) & 15;
        if (i > n)
            i = n;
        memcpy(dst, src, i);
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, n);
}

static void fence(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller goes on (and commits) */
#endif
}

static int get_buffers(PyObject *args, Py_buffer *dst, Py_buffer *src) {
    if (!PyArg_ParseTuple(args, "w*y*", dst, src))
        return -1;
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes but src is %zd", dst->len, src->len);
        PyBuffer_Release(dst);
        PyBuffer_Release(src);
        return -1;
    }
    return 0;
}

static PyObject *copy_hash(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    XXH64_hash_t h;
    (void)self;
    if (get_buffers(args, &dst, &src) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    {
        size_t n = (size_t)src.len;
        const char *s = (const char *)src.buf;
        char *d = (char *)dst.buf;
        int stream = n >= STREAM_MIN;
        if (n <= CHUNK) {
            h = XXH3_64bits(s, n);
            copy_bytes(d, s, n, stream);
        } else {
            XXH3_state_t state;
            XXH3_64bits_reset(&state);
            for (size_t o = 0; o < n; o += CHUNK) {
                size_t c = n - o < CHUNK ? n - o : CHUNK;
                XXH3_64bits_update(&state, s + o, c);
                copy_bytes(d + o, s + o, c, stream);
            }
            h = XXH3_64bits_digest(&state);
        }
        if (stream)
            fence();
    }
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
    if (m != NULL && PyModule_AddIntConstant(m, "CHUNK_BYTES", (long)CHUNK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
