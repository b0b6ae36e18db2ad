/* The host tier's compact id map: packed block id -> slot ref, with no Python
 * object per id. tiers/idmap.py holds the contract and the pure-Python fallback (PyIdMap) that
 * behaves the same; this is that map in C. Built by `pip install` (setup.py, optional).
 *
 *   m = IdMap(seed)            seed: a random 64-bit int (hashing is seeded per process)
 *   m.add_class(nslots) -> i   a size class of nslots records (ref = i << 32 | slot)
 *   m[id] = ref                id (bytes, at most 254 bytes) is held at ref; the record of ref
 *                              keeps the id (id_of). An id held at another ref moves; another
 *                              id held at this ref is dropped (a ref holds one id).
 *   m[id], m.get(id, d), id in m, len(m), del m[id], m.pop(id[, d])
 *   iter(m), m.keys(), m.items(), m.values()
 *   m.id_of(ref) -> bytes | None   the last id set at ref (kept after del: the host order
 *                                  names hidden entries by it), None if none ever was
 *
 * Memory: per class, nslots records of 1 + W bytes (W: the longest id set so far in the class;
 * a length byte, then the id), calloc'd: pages of slots never used take no memory. The table:
 * open addressing (linear probing) of 8-byte entries, tag (16 bits of the hash) | class + 1
 * (16 bits) | slot (32 bits), at most 3/4 full (live + deleted); ids are compared through
 * the records. About 1 + W + 8 / load bytes per held id.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ID 254
#define EMPTY 0ULL
#define DELETED 0xFFFFFFFFFFFFFFFFULL
#define MAX_CLASSES 0xFFFE

typedef struct {
    unsigned char *rec; /* nslots * stride bytes: [len + 1 (0: never set)] [id] */
    uint32_t nslots;
    uint32_t stride;
} Class;

typedef struct {
    PyObject_HEAD
    uint64_t *table;
    uint64_t mask;     /* table size - 1 (0 with no table yet) */
    Py_ssize_t used;   /* live entries */
    Py_ssize_t filled; /* live + deleted */
    uint64_t seed;
    uint64_t secret;   /* odd, from the seed: each word is multiplied by it (see hash_id) */
    uint64_t version;  /* bumped on every insertion or deletion (iterators check it) */
    Class *classes;
    uint32_t ncls;
} IdMap;

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 33);
}

/* The full 128-bit product of a and the secret, folded: a step the seed makes non-linear. (A
 * step of a fixed multiply and xor-shift let a flip of a word's top bit, undone by a fixed flip
 * of the next word, give the same hash whatever the seed: 2**(words / 2) ids of one hash.) */
static inline uint64_t fold_mul(uint64_t a, uint64_t secret) {
    __uint128_t r = (__uint128_t)a * secret;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static uint64_t hash_id(uint64_t seed, uint64_t secret, const unsigned char *p, Py_ssize_t n) {
    uint64_t h = seed ^ ((uint64_t)n * 0x9E3779B97F4A7C15ULL);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = fold_mul(h ^ w, secret);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, (size_t)(n - i));
        h = fold_mul(h ^ w, secret);
    }
    return mix(h);
}

#define E_TAG(e) ((uint16_t)((e) >> 48))
#define E_CLS(e) ((uint32_t)(((e) >> 32) & 0xFFFF) - 1)
#define E_SLOT(e) ((uint32_t)(e))
#define H_TAG(h) ((uint16_t)((h) >> 48))

static inline unsigned char *record(IdMap *m, uint32_t cls, uint32_t slot) {
    Class *c = &m->classes[cls];
    return c->rec + (size_t)slot * c->stride;
}

/* Position of id in the table, or -1. */
static Py_ssize_t find(IdMap *m, const unsigned char *p, Py_ssize_t n, uint64_t h) {
    if (!m->table)
        return -1;
    uint16_t tag = H_TAG(h);
    for (uint64_t i = h & m->mask;; i = (i + 1) & m->mask) {
        uint64_t e = m->table[i];
        if (e == EMPTY)
            return -1;
        if (e != DELETED && E_TAG(e) == tag) {
            const unsigned char *r = record(m, E_CLS(e), E_SLOT(e));
            if (r[0] == n + 1 && memcmp(r + 1, p, (size_t)n) == 0)
                return (Py_ssize_t)i;
        }
    }
}

static int resize(IdMap *m, uint64_t size) {
    uint64_t *t = calloc(size, sizeof(uint64_t));
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t mask = size - 1;
    if (m->table) {
        for (uint64_t i = 0; i <= m->mask; i++) {
            uint64_t e = m->table[i];
            if (e == EMPTY || e == DELETED)
                continue;
            const unsigned char *r = record(m, E_CLS(e), E_SLOT(e));
            uint64_t j = hash_id(m->seed, m->secret, r + 1, r[0] - 1) & mask;
            while (t[j] != EMPTY)
                j = (j + 1) & mask;
            t[j] = e;
        }
        free(m->table);
    }
    m->table = t;
    m->mask = mask;
    m->filled = m->used;
    return 0;
}

static int id_arg(PyObject *key, const unsigned char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "ids are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *p = (const unsigned char *)PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

static int ref_arg(IdMap *m, PyObject *v, uint32_t *cls, uint32_t *slot) {
    long long ref = PyLong_AsLongLong(v);
    if (ref == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) { /* as PyIdMap: a ValueError */
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "ref %R names no slot of a class of this map", v);
        }
        return -1;
    }
    if (ref < 0 || (uint64_t)(ref >> 32) >= m->ncls || (uint64_t)(ref & 0xFFFFFFFF) >= m->classes[ref >> 32].nslots) {
        PyErr_Format(PyExc_ValueError, "ref %lld names no slot of a class of this map", ref);
        return -1;
    }
    *cls = (uint32_t)(ref >> 32);
    *slot = (uint32_t)(ref & 0xFFFFFFFF);
    return 0;
}

static PyObject *ref_of(uint64_t e) { return PyLong_FromLongLong((long long)((uint64_t)E_CLS(e) << 32 | E_SLOT(e))); }

static void drop_at(IdMap *m, Py_ssize_t i) {
    uint64_t next = m->table[(i + 1) & m->mask];
    if (next == EMPTY) { /* the end of a run: no probe passes here */
        m->table[i] = EMPTY;
        m->filled--;
    } else {
        m->table[i] = DELETED;
    }
    m->used--;
    m->version++;
}

static int widen(Class *c, Py_ssize_t n) {
    uint32_t stride = (uint32_t)n + 1;
    unsigned char *rec = calloc((size_t)c->nslots, stride);
    if (!rec) {
        PyErr_NoMemory();
        return -1;
    }
    if (c->rec) {
        for (uint32_t s = 0; s < c->nslots; s++) {
            const unsigned char *r = c->rec + (size_t)s * c->stride;
            if (r[0])
                memcpy(rec + (size_t)s * stride, r, r[0]);
        }
        free(c->rec);
    }
    c->rec = rec;
    c->stride = stride;
    return 0;
}

static int set_item(IdMap *m, const unsigned char *p, Py_ssize_t n, uint32_t cls, uint32_t slot) {
    if (n > MAX_ID) {
        PyErr_Format(PyExc_ValueError, "id of %zd bytes; ids are at most %d bytes", n, MAX_ID);
        return -1;
    }
    Class *c = &m->classes[cls];
    if (n + 1 > (Py_ssize_t)c->stride && widen(c, n) < 0)
        return -1;
    if ((m->filled + 1) * 4 > (Py_ssize_t)(m->mask + 1) * 3 || !m->table) {
        uint64_t size = m->table ? m->mask + 1 : 8;
        while ((uint64_t)(m->used + 1) * 2 > size) /* grow to at most half full */
            size *= 2;
        if (resize(m, size) < 0)
            return -1;
    }
    uint64_t h = hash_id(m->seed, m->secret, p, n);
    Py_ssize_t at = find(m, p, n, h);
    if (at >= 0)
        drop_at(m, at); /* held at another ref (or this one): it moves */
    unsigned char *r = c->rec + (size_t)slot * c->stride;
    if (r[0]) { /* another id set at this ref: dropped if it is still held here */
        Py_ssize_t old = find(m, r + 1, r[0] - 1, hash_id(m->seed, m->secret, r + 1, r[0] - 1));
        if (old >= 0 && E_CLS(m->table[old]) == cls && E_SLOT(m->table[old]) == slot)
            drop_at(m, old);
    }
    r[0] = (unsigned char)(n + 1);
    memcpy(r + 1, p, (size_t)n);
    uint64_t e = (uint64_t)H_TAG(h) << 48 | (uint64_t)(cls + 1) << 32 | slot;
    uint64_t i = h & m->mask;
    while (m->table[i] != EMPTY && m->table[i] != DELETED)
        i = (i + 1) & m->mask;
    if (m->table[i] == EMPTY)
        m->filled++;
    m->table[i] = e;
    m->used++;
    m->version++;
    return 0;
}

/* -- the type ------------------------------------------------------------------------------ */

static int IdMap_init(IdMap *m, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|K", kwlist, &seed))
        return -1;
    if (m->table && seed != m->seed) { /* the held ids were placed by the old seed's hashes */
        PyErr_SetString(PyExc_RuntimeError, "the seed of an IdMap that holds ids cannot change");
        return -1;
    }
    m->seed = seed;
    m->secret = mix(seed ^ 0x243F6A8885A308D3ULL) | 1;
    return 0;
}

static PyObject *IdMap_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    IdMap *m = (IdMap *)PyType_GenericNew(type, args, kw);
    if (m)
        m->secret = mix(0x243F6A8885A308D3ULL) | 1; /* seed 0's, until __init__ */
    return (PyObject *)m;
}

static void IdMap_dealloc(IdMap *m) {
    free(m->table);
    for (uint32_t i = 0; i < m->ncls; i++)
        free(m->classes[i].rec);
    PyMem_RawFree(m->classes);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *IdMap_add_class(IdMap *m, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear(); /* as PyIdMap: a ValueError */
        n = -1;
    }
    if (n < 0 || n > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "nslots %lld: 0 to 2**32 - 1", n);
        return NULL;
    }
    if (m->ncls >= MAX_CLASSES) {
        PyErr_Format(PyExc_ValueError, "at most %d size classes", MAX_CLASSES);
        return NULL;
    }
    Class *cs = PyMem_RawRealloc(m->classes, sizeof(Class) * (m->ncls + 1));
    if (!cs)
        return PyErr_NoMemory();
    m->classes = cs;
    cs[m->ncls] = (Class){NULL, (uint32_t)n, 0};
    return PyLong_FromUnsignedLong(m->ncls++);
}

static Py_ssize_t IdMap_len(IdMap *m) { return m->used; }

static Py_ssize_t lookup(IdMap *m, PyObject *key) {
    const unsigned char *p;
    Py_ssize_t n;
    if (id_arg(key, &p, &n) < 0)
        return -2;
    return find(m, p, n, hash_id(m->seed, m->secret, p, n));
}

static PyObject *IdMap_subscript(IdMap *m, PyObject *key) {
    Py_ssize_t i = lookup(m, key);
    if (i == -2)
        return NULL;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return ref_of(m->table[i]);
}

static int IdMap_ass_subscript(IdMap *m, PyObject *key, PyObject *v) {
    const unsigned char *p;
    Py_ssize_t n;
    if (id_arg(key, &p, &n) < 0)
        return -1;
    if (v == NULL) {
        Py_ssize_t i = find(m, p, n, hash_id(m->seed, m->secret, p, n));
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        drop_at(m, i);
        return 0;
    }
    uint32_t cls, slot;
    if (ref_arg(m, v, &cls, &slot) < 0)
        return -1;
    return set_item(m, p, n, cls, slot);
}

static int IdMap_contains(IdMap *m, PyObject *key) {
    Py_ssize_t i = lookup(m, key);
    return i == -2 ? -1 : i >= 0;
}

static PyObject *IdMap_get(IdMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(id, default=None)");
        return NULL;
    }
    Py_ssize_t i = lookup(m, args[0]);
    if (i == -2)
        return NULL;
    if (i >= 0)
        return ref_of(m->table[i]);
    PyObject *d = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(d);
    return d;
}

static PyObject *IdMap_pop(IdMap *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(id[, default])");
        return NULL;
    }
    Py_ssize_t i = lookup(m, args[0]);
    if (i == -2)
        return NULL;
    if (i >= 0) {
        PyObject *r = ref_of(m->table[i]);
        drop_at(m, i);
        return r;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *IdMap_id_of(IdMap *m, PyObject *arg) {
    uint32_t cls, slot;
    if (ref_arg(m, arg, &cls, &slot) < 0)
        return NULL;
    Class *c = &m->classes[cls];
    if (!c->rec)
        Py_RETURN_NONE;
    const unsigned char *r = c->rec + (size_t)slot * c->stride;
    if (!r[0])
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)r + 1, r[0] - 1);
}

/* -- iteration ---------------------------------------------------------------------------- */

enum { IT_KEYS, IT_VALUES, IT_ITEMS };

typedef struct {
    PyObject_HEAD
    IdMap *map;
    uint64_t pos;
    uint64_t version;
    int kind;
} IdMapIter;

static PyTypeObject IdMapIterType;

static PyObject *make_iter(IdMap *m, int kind) {
    IdMapIter *it = PyObject_New(IdMapIter, &IdMapIterType);
    if (!it)
        return NULL;
    Py_INCREF(m);
    it->map = m;
    it->pos = 0;
    it->version = m->version;
    it->kind = kind;
    return (PyObject *)it;
}

static void IdMapIter_dealloc(IdMapIter *it) {
    Py_DECREF(it->map);
    PyObject_Free(it);
}

static PyObject *IdMapIter_next(IdMapIter *it) {
    IdMap *m = it->map;
    if (it->version != m->version) {
        PyErr_SetString(PyExc_RuntimeError, "IdMap changed during iteration");
        return NULL;
    }
    if (!m->table)
        return NULL;
    while (it->pos <= m->mask) {
        uint64_t e = m->table[it->pos++];
        if (e == EMPTY || e == DELETED)
            continue;
        if (it->kind == IT_VALUES)
            return ref_of(e);
        const unsigned char *r = record(m, E_CLS(e), E_SLOT(e));
        PyObject *k = PyBytes_FromStringAndSize((const char *)r + 1, r[0] - 1);
        if (!k || it->kind == IT_KEYS)
            return k;
        PyObject *v = ref_of(e);
        if (!v) {
            Py_DECREF(k);
            return NULL;
        }
        PyObject *t = PyTuple_Pack(2, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        return t;
    }
    return NULL;
}

static PyObject *IdMap_iter(IdMap *m) { return make_iter(m, IT_KEYS); }
static PyObject *IdMap_keys(IdMap *m, PyObject *Py_UNUSED(x)) { return make_iter(m, IT_KEYS); }
static PyObject *IdMap_values(IdMap *m, PyObject *Py_UNUSED(x)) { return make_iter(m, IT_VALUES); }
static PyObject *IdMap_items(IdMap *m, PyObject *Py_UNUSED(x)) { return make_iter(m, IT_ITEMS); }

static PyObject *IdMap_nbytes(IdMap *m, PyObject *Py_UNUSED(x)) {
    size_t b = m->table ? (m->mask + 1) * sizeof(uint64_t) : 0;
    for (uint32_t i = 0; i < m->ncls; i++)
        b += (size_t)m->classes[i].nslots * m->classes[i].stride;
    return PyLong_FromSize_t(b);
}

static PyTypeObject IdMapIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.tiers._idmap.IdMapIterator",
    .tp_basicsize = sizeof(IdMapIter),
    .tp_dealloc = (destructor)IdMapIter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)IdMapIter_next,
};

static PyMethodDef IdMap_methods[] = {
    {"add_class", (PyCFunction)IdMap_add_class, METH_O, "add_class(nslots) -> class index"},
    {"get", (PyCFunction)(void (*)(void))IdMap_get, METH_FASTCALL, "get(id, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))IdMap_pop, METH_FASTCALL, "pop(id[, default])"},
    {"id_of", (PyCFunction)IdMap_id_of, METH_O, "id_of(ref) -> the last id set at ref, or None"},
    {"keys", (PyCFunction)IdMap_keys, METH_NOARGS, "iterator over the ids"},
    {"values", (PyCFunction)IdMap_values, METH_NOARGS, "iterator over the refs"},
    {"items", (PyCFunction)IdMap_items, METH_NOARGS, "iterator over (id, ref)"},
    {"nbytes", (PyCFunction)IdMap_nbytes, METH_NOARGS, "bytes of the table and records (allocated; untouched pages take no memory)"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods IdMap_mapping = {
    .mp_length = (lenfunc)IdMap_len,
    .mp_subscript = (binaryfunc)IdMap_subscript,
    .mp_ass_subscript = (objobjargproc)IdMap_ass_subscript,
};

static PySequenceMethods IdMap_sequence = {
    .sq_contains = (objobjproc)IdMap_contains,
};

static PyTypeObject IdMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.tiers._idmap.IdMap",
    .tp_basicsize = sizeof(IdMap),
    .tp_dealloc = (destructor)IdMap_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "packed block id -> slot ref (see tiers/idmap.py)",
    .tp_iter = (getiterfunc)IdMap_iter,
    .tp_methods = IdMap_methods,
    .tp_as_mapping = &IdMap_mapping,
    .tp_as_sequence = &IdMap_sequence,
    .tp_init = (initproc)IdMap_init,
    .tp_new = IdMap_new,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_idmap", "The host tier's compact id map.", -1, NULL};

PyMODINIT_FUNC PyInit__idmap(void) {
    if (PyType_Ready(&IdMapType) < 0 || PyType_Ready(&IdMapIterType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (!mod)
        return NULL;
    Py_INCREF(&IdMapType);
    if (PyModule_AddObject(mod, "IdMap", (PyObject *)&IdMapType) < 0) {
        Py_DECREF(&IdMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
