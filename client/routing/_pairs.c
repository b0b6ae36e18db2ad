/* The pairs layout of the router's index (client/routing/pairs.py): one open-addressing
 * table of (key fingerprint, column) pairs, so a key costs what its locations cost (10 bytes
 * a pair at the table's load) and nothing grows with the number of columns. Built by
 * `pip install` (setup.py, optional); the pairs layout needs it (the bit matrix does not).
 *
 * The table is two arrays of the same length (its capacity, any number >= 16): fps uint64 (0:
 * an empty slot) and cols uint16 (the pair's column). A pair sits at or after its home slot
 * (its fingerprint scaled to the capacity), linear probing, no slot empty between its home
 * and it; a removal shifts the pairs after it back (no tombstones), so "the run from a key's
 * home to the next empty slot" holds every pair of that key.
 *
 * A key's fingerprint: its bytes read as little-endian 64-bit words, each mixed into the
 * previous value by the splitmix64 finalizer (the length first); 0 is read as 1. kvtier's
 * keys are keyed hashes already, so two keys of a fleet share a fingerprint with odds near
 * 2^-64 for each pair of keys.
 *
 *   insert(fps, cols, keys, col) -> added
 *       Add (key, col) for each key of the list (bytes) that lacks it; a key that is not bytes
 *       raises before anything changes. The caller keeps the table below its load limit: a
 *       table left with no empty slot raises (the keys before that one stay added).
 *   remove(fps, cols, keys, col) -> removed
 *       Remove (key, col) for each key that has it.
 *   gather(fps, cols, keys, bits, nwords, first, rows) -> m
 *       For key i, OR into row first + i of bits (a (rows, nwords) uint64 matrix) the bit of
 *       each column it has, and bit 0 (ALWAYS) when it has one. With rows (an int64 buffer of
 *       len(keys) + 2, not None): after the OR, rows gets -1, then first + i where that row
 *       has bit 0 (-1 elsewhere), then -1, and m is how many leading rows have it; without,
 *       m is how many keys had a pair here.
 *   clear(fps, cols, mask) -> removed
 *       Remove every pair whose column c has mask[c] != 0 (mask: bytes-like, one byte per
 *       column; columns past its end are kept).
 *   rehash(fps, cols, new_fps, new_cols) -> moved
 *       Place every pair of the first table in the second (empty, large enough).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ALWAYS_BIT ((uint64_t)1)

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static inline uint64_t fingerprint(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = mix64(0x9E3779B97F4A7C15ULL ^ (uint64_t)n);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = mix64(h ^ w);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, (size_t)(n - i));
        h = mix64(h ^ w);
    }
    return h ? h : 1;
}

static inline size_t home(uint64_t fp, size_t cap) { return (size_t)(((unsigned __int128)fp * cap) >> 64); }

typedef struct {
    Py_buffer bf, bc;
    uint64_t *fps;
    uint16_t *cols;
    size_t cap;
    int got;
} Table;

static void table_release(Table *t) {
    if (t->got >= 1)
        PyBuffer_Release(&t->bf);
    if (t->got >= 2)
        PyBuffer_Release(&t->bc);
    t->got = 0;
}

static int table_get(PyObject *fps, PyObject *cols, Table *t, const char *fn) {
    t->got = 0;
    if (PyObject_GetBuffer(fps, &t->bf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    t->got = 1;
    if (PyObject_GetBuffer(cols, &t->bc, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        table_release(t);
        return -1;
    }
    t->got = 2;
    if (t->bf.itemsize != 8 || t->bc.itemsize != 2 || t->bf.len / 8 != t->bc.len / 2 || t->bf.len / 8 < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): fps must be uint64 and cols uint16 of one length", fn);
        table_release(t);
        return -1;
    }
    t->fps = (uint64_t *)t->bf.buf;
    t->cols = (uint16_t *)t->bc.buf;
    t->cap = (size_t)(t->bf.len / 8);
    return 0;
}

static int key_fp(PyObject *key, uint64_t *fp) {
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(key, &p, &n) < 0)
        return -1;
    *fp = fingerprint((const unsigned char *)p, n);
    return 0;
}

/* 1: added, 0: present, -1: no empty slot */
static int put(Table *t, uint64_t fp, uint16_t col) {
    size_t i = home(fp, t->cap);
    for (size_t k = 0; k < t->cap; k++) {
        uint64_t f = t->fps[i];
        if (f == 0) {
            t->fps[i] = fp;
            t->cols[i] = col;
            return 1;
        }
        if (f == fp && t->cols[i] == col)
            return 0;
        if (++i == t->cap)
            i = 0;
    }
    return -1;
}

/* Empty slot i and shift the pairs after it back (each to the hole when the hole lies in its
 * run from its home). */
static void drop_at(Table *t, size_t i) {
    size_t j = i;
    for (;;) {
        if (++j == t->cap)
            j = 0;
        uint64_t f = t->fps[j];
        if (f == 0 || j == i)
            break;
        size_t h = home(f, t->cap);
        size_t dj = (j + t->cap - h) % t->cap, dij = (j + t->cap - i) % t->cap;
        if (dj >= dij) { /* the hole is between its home and it */
            t->fps[i] = f;
            t->cols[i] = t->cols[j];
            i = j;
        }
    }
    t->fps[i] = 0;
    t->cols[i] = 0;
}

static int del(Table *t, uint64_t fp, uint16_t col) {
    size_t i = home(fp, t->cap);
    for (size_t k = 0; k < t->cap; k++) {
        uint64_t f = t->fps[i];
        if (f == 0)
            return 0;
        if (f == fp && t->cols[i] == col) {
            drop_at(t, i);
            return 1;
        }
        if (++i == t->cap)
            i = 0;
    }
    return 0;
}

static PyObject *seq_of(PyObject *keys) { return PySequence_Fast(keys, "keys must be a sequence of bytes"); }

/* Every key's fingerprint, before anything changes (a key that is not bytes changes nothing):
 * a new buffer (PyMem_Free it), its length in *n; NULL with an exception set. */
static uint64_t *fps_of(PyObject *keys, Py_ssize_t *n) {
    PyObject *seq = seq_of(keys);
    if (seq == NULL)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *out = PyMem_Malloc(sizeof(uint64_t) * (size_t)(*n > 0 ? *n : 1));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (key_fp(items[i], &out[i]) < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return out;
}

static int parse_col(PyObject *o, uint16_t *col) {
    long c = PyLong_AsLong(o);
    if (c == -1 && PyErr_Occurred())
        return -1;
    if (c < 0 || c > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "a column must be in 0..65535");
        return -1;
    }
    *col = (uint16_t)c;
    return 0;
}

/* insert() and remove(): (key, col) for each key, put (when absent) or deleted (when held). */
static PyObject *pairs_change(PyObject *const *args, Py_ssize_t nargs, int removing) {
    const char *fn = removing ? "remove" : "insert";
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s(fps, cols, keys, col)", fn);
        return NULL;
    }
    uint16_t col;
    if (parse_col(args[3], &col) < 0)
        return NULL;
    Table t;
    if (table_get(args[0], args[1], &t, fn) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t changed = 0, n = 0;
    uint64_t *fps = fps_of(args[2], &n);
    if (fps == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = removing ? del(&t, fps[i], col) : put(&t, fps[i], col);
        if (r < 0) {
            PyErr_Format(PyExc_RuntimeError, "%s(): the pairs table is full (the caller grows it first)", fn);
            goto done;
        }
        changed += r;
    }
    res = PyLong_FromSsize_t(changed);
done:
    PyMem_Free(fps);
    table_release(&t);
    return res;
}

static PyObject *pairs_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return pairs_change(args, nargs, 0);
}

static PyObject *pairs_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return pairs_change(args, nargs, 1);
}

static PyObject *pairs_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "gather(fps, cols, keys, bits, nwords, first, rows)");
        return NULL;
    }
    Py_ssize_t nwords = PyLong_AsSsize_t(args[4]), first = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred())
        return NULL;
    Table t;
    if (table_get(args[0], args[1], &t, "gather") < 0)
        return NULL;
    Py_buffer bb, br;
    int have_bits = 0, have_rows = 0;
    PyObject *seq = NULL, *res = NULL;
    if (PyObject_GetBuffer(args[3], &bb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    have_bits = 1;
    if (args[6] != Py_None) {
        if (PyObject_GetBuffer(args[6], &br, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        have_rows = 1;
    }
    seq = seq_of(args[2]);
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t nrows = nwords > 0 ? bb.len / 8 / nwords : 0;
    if (bb.itemsize != 8 || nwords <= 0 || first < 0 || first + n > nrows ||
        (have_rows && (br.itemsize != 8 || br.len / 8 < n + 2))) {
        PyErr_SetString(PyExc_ValueError, "gather(): arguments do not match the matrix");
        goto done;
    }
    uint64_t *bits = (uint64_t *)bb.buf;
    uint64_t limit = (uint64_t)nwords * 64;
    Py_ssize_t found = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t fp;
        if (key_fp(items[i], &fp) < 0)
            goto done;
        uint64_t *row = bits + (size_t)(first + i) * (size_t)nwords;
        size_t s = home(fp, t.cap);
        int hit = 0;
        for (size_t k = 0; k < t.cap; k++) {
            uint64_t f = t.fps[s];
            if (f == 0)
                break;
            if (f == fp) {
                uint64_t c = t.cols[s];
                if (c < limit) {
                    row[c >> 6] |= (uint64_t)1 << (c & 63);
                    hit = 1;
                }
            }
            if (++s == t.cap)
                s = 0;
        }
        if (hit) {
            row[0] |= ALWAYS_BIT;
            found++;
        }
    }
    if (have_rows) {
        int64_t *rows = (int64_t *)br.buf;
        Py_ssize_t m = -1;
        rows[0] = rows[n + 1] = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            int live = (bits[(size_t)(first + i) * (size_t)nwords] & ALWAYS_BIT) != 0;
            rows[i + 1] = live ? first + i : -1;
            if (!live && m < 0)
                m = i;
        }
        found = m < 0 ? n : m;
    }
    res = PyLong_FromSsize_t(found);
done:
    Py_XDECREF(seq);
    if (have_rows)
        PyBuffer_Release(&br);
    if (have_bits)
        PyBuffer_Release(&bb);
    table_release(&t);
    return res;
}

static PyObject *pairs_clear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "clear(fps, cols, mask)");
        return NULL;
    }
    Table t;
    if (table_get(args[0], args[1], &t, "clear") < 0)
        return NULL;
    Py_buffer bm;
    if (PyObject_GetBuffer(args[2], &bm, PyBUF_SIMPLE) < 0) {
        table_release(&t);
        return NULL;
    }
    const unsigned char *mask = (const unsigned char *)bm.buf;
    size_t mlen = (size_t)bm.len, cap = t.cap, start = 0, removed = 0;
    while (start < cap && t.fps[start] != 0) /* begin after an empty slot: no run crosses it */
        start++;
    if (start == cap) {
        PyErr_SetString(PyExc_RuntimeError, "clear(): the pairs table has no empty slot");
        PyBuffer_Release(&bm);
        table_release(&t);
        return NULL;
    }
    /* a removal shifts later pairs back into the hole, which is then looked at again; pairs
     * only move towards the scan's position, never past the empty slot it started from */
    size_t i = start, seen = 0;
    while (seen < cap) {
        uint64_t f = t.fps[i];
        size_t c = t.cols[i];
        if (f != 0 && c < mlen && mask[c]) {
            drop_at(&t, i);
            removed++;
            continue;
        }
        if (++i == cap)
            i = 0;
        seen++;
    }
    PyBuffer_Release(&bm);
    table_release(&t);
    return PyLong_FromSize_t(removed);
}

static PyObject *pairs_rehash(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "rehash(fps, cols, new_fps, new_cols)");
        return NULL;
    }
    Table a, b;
    if (table_get(args[0], args[1], &a, "rehash") < 0)
        return NULL;
    if (table_get(args[2], args[3], &b, "rehash") < 0) {
        table_release(&a);
        return NULL;
    }
    size_t moved = 0;
    PyObject *res = NULL;
    for (size_t i = 0; i < a.cap; i++) {
        if (a.fps[i] == 0)
            continue;
        size_t s = home(a.fps[i], b.cap), k = 0;
        while (b.fps[s] != 0 && k++ < b.cap)
            if (++s == b.cap)
                s = 0;
        if (b.fps[s] != 0) {
            PyErr_SetString(PyExc_ValueError, "rehash(): the new table is too small");
            goto done;
        }
        b.fps[s] = a.fps[i];
        b.cols[s] = a.cols[i];
        moved++;
    }
    res = PyLong_FromSize_t(moved);
done:
    table_release(&a);
    table_release(&b);
    return res;
}

static PyObject *pairs_fingerprint(PyObject *self, PyObject *key) {
    (void)self;
    uint64_t fp;
    if (key_fp(key, &fp) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(fp);
}

static PyMethodDef methods[] = {
    {"insert", (PyCFunction)(void (*)(void))pairs_insert, METH_FASTCALL, "Add (key, col) pairs."},
    {"remove", (PyCFunction)(void (*)(void))pairs_remove, METH_FASTCALL, "Remove (key, col) pairs."},
    {"gather", (PyCFunction)(void (*)(void))pairs_gather, METH_FASTCALL, "OR the keys' columns into bit rows."},
    {"clear", (PyCFunction)(void (*)(void))pairs_clear, METH_FASTCALL, "Remove the pairs of masked columns."},
    {"rehash", (PyCFunction)(void (*)(void))pairs_rehash, METH_FASTCALL, "Place every pair in a new table."},
    {"fingerprint", (PyCFunction)pairs_fingerprint, METH_O, "A key's 64-bit fingerprint."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pairs",
                                    "The router index's pairs table, compiled (client/routing/_pairs.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

/* The interface these functions offer (kvtier.client.routing.compiled.PAIRS_ABI). */
#define PAIRS_ABI 1

PyMODINIT_FUNC PyInit__pairs(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", PAIRS_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
