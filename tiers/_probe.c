/* The compiled key-table probe (tiers/keytable.py holds the format and the protocol; this is
 * the same probe without numpy's per-call overhead). Built by `pip install` (setup.py); when it
 * is absent tiers/keytable.py probes with numpy instead, with the same answers.
 *
 *   probe(table, shift, tag, keys, out, checked, spin_limit_ns) -> int
 *
 * table: the mapped table file (any buffer: the reader's mmap); shift: 64 - log2(slots);
 * tag: the layout's tag; keys: a list or tuple of bytes (8 to 32 bytes each); out: a writable
 * buffer of len(keys) bytes, filled with each key's tier bit set (0: not held, or a tombstone).
 * checked: honour each slot's seqlock (read seq, the slot, seq again; use the slot only when
 * both reads are equal and even, else read it again, giving up after spin_limit_ns). Unchecked:
 * read the slots as they are (the caller brackets the call with the table's generation and
 * probes again checked when a write overlapped it). Returns 0, or 1 when a slot stayed
 * mid-update for spin_limit_ns (the caller raises TableUnavailable). Raises ValueError for a
 * key outside 8 to 32 bytes (nothing is probed then).
 *
 * Ordering: x86-64 total store order (the module's ORDERING_SAFE); the loads below are
 * ordered for the compiler with acquire loads and an acquire fence, which are plain moves on
 * x86-64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define HEADER_BYTES 20480
#define SLOT_BYTES 40
#define KEY_MIN 8
#define KEY_MAX 32
#define BATCH 64 /* keys hashed and prefetched ahead of their probes */

static const uint64_t HASH_K[4] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL,
                                   0x165667B19E3779F9ULL, 0xD6E8FEB86659FD93ULL};
#define HASH_FINAL 0xFF51AFD7ED558CCDULL

static inline uint64_t hash_words(uint64_t tag, const uint64_t w[4], uint64_t klen) {
    uint64_t h = 0;
    for (int j = 0; j < 4; j++) {
        uint64_t m = w[j] * HASH_K[j];
        h ^= m ^ (m >> 32);
    }
    h ^= klen | (tag << 8);
    h *= HASH_FINAL;
    return h ^ (h >> 33);
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* One key's tiers; -1 when a slot stayed mid-update past the deadline. */
static int probe_key(const unsigned char *slots, uint64_t mask, uint64_t home, uint16_t tag,
                     const uint64_t want[4], uint8_t klen, int checked, uint64_t spin_limit_ns) {
    uint64_t deadline = 0;
    uint64_t i = home;
    for (uint64_t steps = 0; steps <= mask; steps++) {
        const unsigned char *s = slots + (i & mask) * SLOT_BYTES;
        const uint32_t *seqp = (const uint32_t *)s;
        uint32_t s1 = __atomic_load_n(seqp, __ATOMIC_ACQUIRE);
        uint16_t stag;
        uint8_t sklen, stiers;
        uint64_t key[4];
        memcpy(&stag, s + 4, 2);
        sklen = s[6];
        stiers = s[7];
        memcpy(key, s + 8, 32);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (checked) {
            uint32_t s2 = __atomic_load_n(seqp, __ATOMIC_RELAXED);
            if (s1 != s2 || (s1 & 1)) {
                uint64_t t = now_ns();
                if (deadline == 0)
                    deadline = t + spin_limit_ns;
                else if (t > deadline)
                    return -1;
                steps--; /* read the same slot again */
                continue;
            }
        }
        if (stag == 0)
            return 0;
        if (stag == tag && sklen == klen && key[0] == want[0] && key[1] == want[1] && key[2] == want[2] &&
            key[3] == want[3])
            return stiers & 7; /* the tier bits only, whatever else a corrupt byte holds */
        i++;
    }
    return 0; /* a full table (never: the writer keeps it at most 70 % used) */
}

static PyObject *probe(PyObject *self, PyObject *args) {
    PyObject *table, *keys, *out;
    int shift, tag, checked;
    unsigned long long spin_limit_ns;
    if (!PyArg_ParseTuple(args, "OiiOOpK", &table, &shift, &tag, &keys, &out, &checked, &spin_limit_ns))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer tb, ob;
    int rc = 0;
    if (PyObject_GetBuffer(table, &tb, PyBUF_SIMPLE) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&tb);
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t nslots = shift >= 64 || shift < 1 ? 0 : (1ULL << (64 - shift));
    /* nslots is compared with the slots the buffer holds (a division: 2**63 slots of 40 bytes
     * would wrap to 0 bytes in a product) */
    if (nslots == 0 || tb.len < HEADER_BYTES || nslots > (uint64_t)(tb.len - HEADER_BYTES) / SLOT_BYTES ||
        ob.len < n || tag < 1 || tag > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "table, shift, tag or out do not fit");
        goto fail;
    }
    const unsigned char *slots = (const unsigned char *)tb.buf + HEADER_BYTES;
    uint8_t *res = (uint8_t *)ob.buf;
    uint64_t mask = nslots - 1;
    uint64_t words[BATCH][4];
    uint64_t homes[BATCH];
    uint8_t lens[BATCH];
    for (Py_ssize_t base = 0; base < n; base += BATCH) {
        Py_ssize_t cnt = n - base < BATCH ? n - base : BATCH;
        /* hash the batch and prefetch each home slot, so the misses overlap */
        for (Py_ssize_t j = 0; j < cnt; j++) {
            PyObject *k = items[base + j];
            const char *p;
            Py_ssize_t len;
            Py_buffer kb;
            int view = 0;
            if (PyBytes_Check(k)) {
                p = PyBytes_AS_STRING(k);
                len = PyBytes_GET_SIZE(k);
            } else {
                if (PyObject_GetBuffer(k, &kb, PyBUF_SIMPLE) < 0)
                    goto fail;
                p = kb.buf;
                len = kb.len;
                view = 1;
                /* an exporter written in Python (3.12's __buffer__) may have changed the list */
                if (PySequence_Fast_GET_SIZE(seq) != n) {
                    PyBuffer_Release(&kb);
                    PyErr_SetString(PyExc_RuntimeError, "keys changed during the probe");
                    goto fail;
                }
                items = PySequence_Fast_ITEMS(seq);
            }
            if (len < KEY_MIN || len > KEY_MAX) {
                if (view)
                    PyBuffer_Release(&kb);
                PyErr_Format(PyExc_ValueError, "key %zd is %zd bytes; keys are %d to %d bytes", base + j, len,
                             KEY_MIN, KEY_MAX);
                goto fail;
            }
            memset(words[j], 0, 32);
            memcpy(words[j], p, (size_t)len);
            if (view)
                PyBuffer_Release(&kb);
            lens[j] = (uint8_t)len;
            homes[j] = hash_words((uint64_t)tag, words[j], (uint64_t)len) >> shift;
            __builtin_prefetch(slots + (homes[j] & mask) * SLOT_BYTES);
        }
        for (Py_ssize_t j = 0; j < cnt; j++) {
            int t = probe_key(slots, mask, homes[j], (uint16_t)tag, words[j], lens[j], checked,
                              (uint64_t)spin_limit_ns);
            if (t < 0) {
                rc = 1;
                goto done;
            }
            res[base + j] = (uint8_t)t;
        }
    }
done:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&tb);
    Py_DECREF(seq);
    return PyLong_FromLong(rc);
fail:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&tb);
    Py_DECREF(seq);
    return NULL;
}

/* The table's generation (header offset 64), an acquire load. */
static PyObject *generation(PyObject *self, PyObject *table) {
    Py_buffer tb;
    if (PyObject_GetBuffer(table, &tb, PyBUF_SIMPLE) < 0)
        return NULL;
    if (tb.len < HEADER_BYTES) {
        PyBuffer_Release(&tb);
        PyErr_SetString(PyExc_ValueError, "not a key table");
        return NULL;
    }
    uint64_t g = __atomic_load_n((const uint64_t *)((const char *)tb.buf + 64), __ATOMIC_ACQUIRE);
    PyBuffer_Release(&tb);
    return PyLong_FromUnsignedLongLong(g);
}

/* (leading run of masks with a bit of fast_bits, leading run of non-zero masks): prefix_lengths. */
static PyObject *prefix(PyObject *self, PyObject *args) {
    Py_buffer mb;
    int fast_bits;
    if (!PyArg_ParseTuple(args, "y*i", &mb, &fast_bits))
        return NULL;
    const uint8_t *m = (const uint8_t *)mb.buf;
    Py_ssize_t n = mb.len, nfast = n, nany = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (nfast == n && !(m[i] & fast_bits))
            nfast = i;
        if (!m[i]) {
            nany = i;
            break;
        }
    }
    PyBuffer_Release(&mb);
    return Py_BuildValue("(nn)", nfast, nany);
}

/* counts[m] += 1 for each mask m (counts: a writable buffer of 8-byte counters, one per mask). */
static PyObject *tally(PyObject *self, PyObject *args) {
    Py_buffer mb, cb;
    if (!PyArg_ParseTuple(args, "y*w*", &mb, &cb))
        return NULL;
    const uint8_t *m = (const uint8_t *)mb.buf;
    uint64_t *c = (uint64_t *)cb.buf;
    Py_ssize_t nc = cb.len / 8;
    int bad = 0;
    for (Py_ssize_t i = 0; i < mb.len; i++) /* checked first: a refused call counts nothing */
        bad |= m[i] >= nc;
    if (!bad)
        for (Py_ssize_t i = 0; i < mb.len; i++)
            c[m[i]]++;
    PyBuffer_Release(&mb);
    PyBuffer_Release(&cb);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a mask beyond the counters");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prefix", prefix, METH_VARARGS, "prefix(masks, fast_bits) -> (leading fast run, leading held run)"},
    {"tally", tally, METH_VARARGS, "tally(masks, counts): counts[m] += 1 for each mask m (uint64 counters)"},
    {"probe", probe, METH_VARARGS, "probe(table, shift, tag, keys, out, checked, spin_limit_ns) -> 0 | 1"},
    {"generation", generation, METH_O, "generation(table) -> the table's generation counter"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", "The compiled key-table probe.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
