/* The router's decision without numpy's per-call overhead (client/routing/index.py and
 * scoring.py hold the formats and the numpy code this replaces, with the same answers). Built
 * by `pip install` (setup.py, optional); when it is absent the router runs the numpy path.
 *
 *   rows(keys, slots, tags, packed, high, shift, out) -> int
 *       The rows of a request's keys in the RowTable (rowtable.py): keys a list of bytes;
 *       slots int32 and tags uint8 (the open-addressing table), packed the (rows, 16 bytes)
 *       keys; out an int64 buffer of len(keys) + 2, filled with -1, the row of each key (-1:
 *       not indexed), -1. Returns how many leading keys are indexed, or -1 (nothing written
 *       that counts) when a key is not 16 bytes: the caller takes the general path. A key is
 *       first compared with the row after the previous key's (keys that arrived together got
 *       consecutive rows), and otherwise probed; a row is taken only when its stored key
 *       equals the key (a key of zeros, which free rows read as, is always probed).
 *
 *   lead(rows, m, bits, nwords, table, n_workers, remote, out)
 *       LocationIndex.holdings over the plan's byte table (index.py, Holdings): rows as rows()
 *       wrote them, m the indexed keys (> 0), bits the (rows, nwords) uint64 matrix, table the
 *       plan's byte table transposed, (nwords * 8 * 256, 4 * words): a byte value's masks of
 *       every tier side by side; out the (4, n_workers) int64 leads.
 *
 *   sparse(rows, n, bits, nwords, table, n_workers, kh, kany, lead)
 *       LocationIndex._sparse_walk over the plan's byte table (index.py, Sparse indexing): rows
 *       as rows() wrote them (the row of every one of the n keys, -1 where not indexed: read as
 *       row 0, the empty padding row), lead the (4, n_workers) dense leads, extended in place:
 *       per worker, from its gpu run over the keys held in gpu or host in steps of at most kh
 *       (d_host: at least the dense one), from there over the keys held anywhere of its own in
 *       steps of at most kany (d_disk: at least the dense one), and d_remote at least d_disk.
 *       A walk from s steps from one held position to the next while the step (counted from
 *       s - 1) is at most k; it answers one past the last position reached (s when none).
 *
 *   lead_cols(rows, m, bits, nwords, fast, rsel, rmask, remote, lead)
 *       lead() for plans too wide for a byte table: fast as sparse_cols()'s, rsel each worker's
 *       remote mask (an index into rmask, the (masks, nwords) uint64 remote masks), lead the
 *       (4, n_workers) int64 out: per worker the first of the m indexed keys not held on GPU
 *       (gpu or speculative), in GPU or host, anywhere of its own, and (remote) also in its
 *       remote mask (without remote: d_disk), m where every one is.
 *
 *   sparse_cols(rows, n, bits, nwords, fast, n_workers, kh, kany, lead)
 *       sparse() for plans too wide for a byte table: fast the plan's (5, n_workers) int64
 *       columns (gpu, speculative 0, speculative 1, host, disk of each worker); the keys'
 *       rows turned into a mask of positions per column once, each worker's walk runs over
 *       the OR of its columns' masks.
 *
 *   rank(n, lead, weights, load_cost, queued, active, digests, key_digest, top_k, cost, saved,
 *        pairwise) -> list
 *       Scorer.costs then Scorer.order: saved = sum over the 4 tiers of lead * weight (in
 *       the order numpy's einsum adds them: in tier order, or with pairwise as (0 + 2) + (1 +
 *       3)), cost = (n - saved) + load_cost (written to cost and saved), then the
 *       indices of the best top_k workers by (cost rounded to 1e-9, queued, active, tie hash,
 *       index), as numpy's stable lexsort orders them.
 *
 *   decide(keys, slots, tags, packed, high, shift, bits, nwords, table, remote, workers, loads,
 *          spec_gen, top_k, rows, live, free, aux, kh, kany[, pairwise])
 *          -> (rows, m, order, saved_best, fetch, speculated, arrays)
 *       rows() into rows (a scratch buffer of at least len(keys) + 2), then lead() (zeros when
 *       no key is indexed), with sparse deep tiers (kh > 0: the host stride, kany the larger of
 *       the host and disk strides; 0, 0: dense) then sparse() over every key, then rank() over
 *       every worker in one call (pairwise as rank()'s, always with one worker), the tie hash's key
 *       digest (blake2b-64 of the last key, or of b"" without keys: scoring._digest64) made
 *       here. workers: the plan's per-worker arrays in one uint64 buffer of 7 x workers: the
 *       (4, workers) float64 weights, the digests, the speculative columns of generation 0,
 *       then of 1; loads: the (3, workers) float64 queued, active and load cost. Returns rows
 *       itself, the indexed keys, order, the best worker's saved blocks, whether it counted
 *       remote blocks (its remote weight > 0 and d_remote > d_disk: the caller makes the fetch
 *       hints), whether the request's speculative entries were set here, and arrays: a new
 *       bytes object of the (4, workers) float64 cost, saved, copies of queued and active,
 *       then the (4, workers) int64 leads. spec_gen (-1: not dispatched) is the speculative
 *       generation: when every key is indexed and no fetch hint is needed, the best worker's
 *       column of it is set in the keys' rows (what LocationIndex.speculate would do;
 *       otherwise the caller speculates); when some keys are not indexed, they get rows first
 *       as fill() gives them (live the table's live flags, free the free rows, aux int64
 *       [nfree, keys in the table, -, -]), only where there is room for all of them without
 *       growing the matrix or the table: then aux is [nfree, rows made, high, 1], or 2 for
 *       its last item when a key found no slot near its home (the caller rebuilds the table;
 *       nothing speculated). None when a key is not 16 bytes (nothing done).
 *
 *   digest64(data) -> int
 *       blake2b with an 8-byte digest of data (bytes, at most 128), read little-endian: the
 *       same number as scoring._digest64.
 *
 *   insert(keys, rows, packed, live, slots, tags, shift) -> int
 *       RowTable.insert for keys of 16 bytes (distinct, none indexed; rows not live; the
 *       table keeps room for them: rowtable.room): each key stored at its row, the row live,
 *       then placed in the first free slot of the less full of its two buckets. Returns 1; 0
 *       when both of one's buckets were full (the caller rebuilds the table twice as large,
 *       from the live rows); -1 when a key is not 16 bytes (nothing done).
 *
 *   place(rows, packed, slots, tags, shift) -> int
 *       The placement of insert() for rows whose keys are stored already (a rebuild): 1, or 0
 *       when both of one's buckets were full.
 *
 *   set_bit(bits, nwords, rows, count, col)
 *       Set column col in the first count rows of rows (int64; each >= 0).
 *
 *   unset(keys, slots, tags, packed, high, shift, bits, nwords, col) -> int
 *       A removed event's fold (LocationIndex.removed): column col cleared in the row of each
 *       of the keys that is indexed (probed as rows() does). Returns how many keys were (each
 *       time a key repeats), or -1 when a key is not 16 bytes (nothing done); a row beyond
 *       the matrix (a corrupt table) raises ValueError, the rows before it cleared.
 *
 *   fill(keys, rows, slots, tags, packed, live, bits, nwords, free, nfree, high, shift, col[, fresh])
 *       -> (status, made, high, nfree)
 *       LocationIndex._fill for keys of 16 bytes: rows (int64, one per key, -1 where not
 *       indexed) gets a row for each key at -1: the row a key of this call got already (a key
 *       repeated), else the last of the first nfree free rows, else row high (high + 1 after
 *       it), never the matrix's last row; the key is stored at its row, the row made live, its
 *       ALWAYS bit set and placed in the table (which the caller keeps with room for these keys:
 *       rowtable.room). With col >= 0, then column col is set in every key's row. Status 1:
 *       done; 2: no row left (the caller grows the matrix and calls again: rows given so far
 *       are in rows); 0: both of a key's buckets were full (it is stored and live: the
 *       caller rebuilds the table twice as large and calls again). None when a key is not 16
 *       bytes (nothing done). With fresh (the caller's word that no key at -1 is in the table:
 *       rows() just said so), a repeated key is found among this call's keys, not in the table.
 *
 * Compiled with -ffp-contract=off: no fused multiply-add, so the sums round as numpy's do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WIDTH 16
#define WINDOW 16 /* slots of a bucket (rowtable.py WINDOW) */
_Static_assert(WINDOW == 16, "probe_bucket and bucket_used read a bucket's tags as two words");
#define FILL_EIGHTHS 6 /* keys a table holds at most, in eighths of its slots (rowtable.py) */
#define C1 0x9E3779B97F4A7C15ULL
#define C2 0xC2B2AE3D27D4EB4FULL
#define MIX1 0x9E3779B97F4A7C15ULL
#define AHEAD 16 /* keys whose home slots are fetched ahead of their probes */
#define KEYS_AHEAD 4 /* key objects whose bytes are fetched ahead of their use */

/* A C-contiguous buffer of the element type kind names, else TypeError (and nothing held):
 * 'q' int64, 'Q' uint64, 'd' float64, 'i' int32, 'B' one byte (uint8, bool), 'K' a 16-byte key
 * (numpy's V16, or bytes). A wrongly typed array must not be read as another type. */
static int get_buf(PyObject *o, Py_buffer *b, int writable, char kind) {
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    int ok;
    switch (kind) {
    case 'q': ok = b->itemsize == 8 && (!strcmp(f, "q") || !strcmp(f, "l")); break;
    case 'Q': ok = b->itemsize == 8 && (!strcmp(f, "Q") || !strcmp(f, "L")); break;
    case 'd': ok = b->itemsize == 8 && !strcmp(f, "d"); break;
    case 'i': ok = b->itemsize == 4 && (!strcmp(f, "i") || !strcmp(f, "l")); break;
    case 'B': ok = b->itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "?") || !strcmp(f, "b") || !strcmp(f, "c")); break;
    default: ok = b->itemsize == WIDTH || (b->itemsize == 1 && !strcmp(f, "B")); break;
    }
    if (!ok) {
        static const char *const names[] = {"int64", "uint64", "float64", "int32", "uint8", "16-byte key"};
        const char *name = names[kind == 'q' ? 0 : kind == 'Q' ? 1 : kind == 'd' ? 2 : kind == 'i' ? 3 : kind == 'B' ? 4 : 5];
        PyErr_Format(PyExc_TypeError, "a C-contiguous %s array was expected, not format %.20s of %zd-byte items", name,
                     b->format ? b->format : "B", b->itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* Acquire n buffers, the j-th from args[at[j]] as kinds[j] (writable where writable[j]) into
 * *out[j]; on a failure the ones already taken are released and -1 returned (exception set). */
static int get_bufs(PyObject *const *args, int n, const int *at, const char *kinds, const char *writable,
                    Py_buffer *const *out) {
    for (int j = 0; j < n; j++)
        if (get_buf(args[at[j]], out[j], writable[j], kinds[j]) < 0) {
            while (j--)
                PyBuffer_Release(out[j]);
            return -1;
        }
    return 0;
}

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------ rows */

/* A 16-byte key's hash: its home slot is h >> shift, its tag the 8 bits below (never 0). */
static inline uint64_t key_hash(const unsigned char *key) {
    uint64_t w0, w1;
    memcpy(&w0, key, 8);
    memcpy(&w1, key + 8, 8);
    return ((w0 * C1) ^ w1) * C2;
}

static inline uint8_t key_tag(uint64_t h, long shift) {
    return (uint8_t)(((h >> (shift - 8)) & 0xFF) | 1);
}

/* A key's two buckets of WINDOW slots (aligned): the one its home slot h >> shift lies in, and
 * one from a second mix of h. A bucket's keys fill it from its first slot, so its first empty
 * slot ends it (a drop rebuilds the table). */
static inline uint64_t bucket1(uint64_t h, long shift) {
    return (h >> shift) & ~(uint64_t)(WINDOW - 1);
}

static inline uint64_t bucket2(uint64_t h, long shift) {
    return (((h ^ (h >> 32)) * C1) >> shift) & ~(uint64_t)(WINDOW - 1);
}

#define LOW7 0x7F7F7F7F7F7F7F7FULL
#define BYTE1 0x0101010101010101ULL

/* The high bit of each nonzero byte of x (exact: no carry between bytes). */
static inline uint64_t nonzero_bytes(uint64_t x) {
    return (((x & LOW7) + LOW7) | x) & ~LOW7;
}

/* How many slots of bucket b hold a key: its nonzero tags (WINDOW is 16: two words of tags). */
static inline int bucket_used(const uint8_t *tags, uint64_t b) {
    uint64_t w0, w1;
    memcpy(&w0, tags + b, 8);
    memcpy(&w1, tags + b + 8, 8);
    /* each word's nonzero bytes as ones in its bytes, summed into the top byte by a multiply */
    return (int)((((nonzero_bytes(w0) >> 7) + (nonzero_bytes(w1) >> 7)) * BYTE1) >> 56);
}

/* Put one key's row in the first free slot of the fuller-free of its two buckets (the first
 * on a tie), with the key's tag; 0 when both are full (the caller rebuilds the table bigger). */
static inline int place_one(const unsigned char *key, int32_t row, int32_t *slots, uint8_t *tags,
                            uint64_t mask, long shift) {
    (void)mask;
    uint64_t h = key_hash(key);
    uint64_t b1 = bucket1(h, shift), b2 = bucket2(h, shift);
    int u1 = bucket_used(tags, b1), u2 = u1 ? bucket_used(tags, b2) : WINDOW; /* an empty first: no tie */
    uint64_t at;
    if (u1 <= u2 && u1 < WINDOW)
        at = b1 + u1;
    else if (u2 < WINDOW)
        at = b2 + u2;
    else
        return 0;
    slots[at] = row;
    tags[at] = key_tag(h, shift);
    return 1;
}

static inline int eq16(const unsigned char *a, const unsigned char *b) {
    uint64_t a0, a1, b0, b1;
    memcpy(&a0, a, 8);
    memcpy(&a1, a + 8, 8);
    memcpy(&b0, b, 8);
    memcpy(&b1, b + 8, 8);
    return a0 == b0 && a1 == b1;
}

/* The row of key among the slots of bucket b whose tag is its tag (an empty slot's tag, 0, is
 * never one), the tags compared a word of 8 at a time; -1 when none holds it. */
static inline int64_t probe_bucket(const int32_t *slots, const uint8_t *tags, const unsigned char *packed,
                                   Py_ssize_t nrows, uint64_t b, uint8_t tag, const unsigned char *key) {
    for (int half = 0; half < WINDOW; half += 8) {
        uint64_t w;
        memcpy(&w, tags + b + half, 8);
        uint64_t same = ~nonzero_bytes(w ^ (BYTE1 * tag)) & ~LOW7;
        while (same) {
            uint64_t at = b + half + (__builtin_ctzll(same) >> 3);
            int32_t r = slots[at];
            if (r >= 0 && r < nrows && eq16(packed + (size_t)r * WIDTH, key)) /* r < nrows: never read
                                                                                  * outside packed */
                return r;
            same &= same - 1;
        }
    }
    return -1;
}

static inline int64_t probe(const int32_t *slots, const uint8_t *tags, const unsigned char *packed,
                            Py_ssize_t nrows, uint64_t mask, int shift, const unsigned char *key) {
    (void)mask;
    uint64_t h = key_hash(key);
    uint8_t tag = key_tag(h, shift);
    uint64_t b1 = bucket1(h, shift), b2 = bucket2(h, shift);
    int64_t r = probe_bucket(slots, tags, packed, nrows, b1, tag, key);
    return r >= 0 || b2 == b1 ? r : probe_bucket(slots, tags, packed, nrows, b2, tag, key);
}

static const unsigned char ZERO[WIDTH] = {0};

static Py_ssize_t rows_core(PyObject *keys, Py_ssize_t n, const int32_t *slots, const uint8_t *tags,
                            const unsigned char *packed, Py_ssize_t nslots, Py_ssize_t nrows, long shift,
                            long long high, int64_t *out) {
    uint64_t mask = (uint64_t)nslots - 1;
    out[0] = out[n + 1] = -1;
    Py_ssize_t indexed = -1;
    int64_t prev = -2;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, i));
        int64_t r;
        if (i + KEYS_AHEAD < n) /* the key objects lie anywhere in the heap: fetch one ahead */
            __builtin_prefetch(PyBytes_AS_STRING(PyList_GET_ITEM(keys, i + KEYS_AHEAD)));
        if (indexed >= 0) { /* after the first unknown key the rest are mostly unknown too, each a
                             * probe of random buckets: fetch their tags AHEAD keys on */
            Py_ssize_t j = i == indexed + 1 ? i : i + AHEAD - 1;
            for (Py_ssize_t end = i + AHEAD < n ? i + AHEAD : n; j < end; j++) {
                const unsigned char *kj = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, j));
                uint64_t w0, w1;
                memcpy(&w0, kj, 8);
                memcpy(&w1, kj + 8, 8);
                uint64_t hj = ((w0 * C1) ^ w1) * C2;
                __builtin_prefetch(tags + bucket1(hj, shift)); /* (a slot is read on a tag's match) */
                __builtin_prefetch(tags + bucket2(hj, shift));
            }
        }
        if (prev >= 0 && prev + 1 < high && eq16(packed + (size_t)(prev + 1) * WIDTH, key) && !eq16(key, ZERO))
            r = prev + 1;
        else {
            r = probe(slots, tags, packed, nrows, mask, (int)shift, key);
        }
        out[i + 1] = r;
        if (r < 0 && indexed < 0)
            indexed = i;
        prev = r;
    }
    return indexed < 0 ? n : indexed;
}

static int keys16(PyObject *keys) {
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != WIDTH)
            return 0;
    }
    return 1;
}

static int table_ok(Py_ssize_t nslots, Py_ssize_t ntags, long shift, long long high, Py_ssize_t nrows) {
    return ntags >= nslots && nslots >= 16 && !(nslots & (nslots - 1)) && shift >= 9 && shift <= 63 &&
           ((uint64_t)1 << (64 - shift)) == (uint64_t)nslots && high <= nrows;
}

/* The keys (args[0], a list) and the row table's high-water mark and shift (args[4], args[5])
 * that rows() and decide() both take; -1 with an exception set when one is wrong. The keys
 * themselves are checked by the caller after all its conversions (an __index__ may change the
 * list). */
static int table_args(PyObject *const *args, const char *name, long long *high, long *shift) {
    if (!PyList_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "%s(): keys must be a list", name);
        return -1;
    }
    *high = PyLong_AsLongLong(args[4]);
    if (*high == -1 && PyErr_Occurred())
        return -1;
    *shift = PyLong_AsLong(args[5]);
    if (*shift == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *route_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 7, "rows"))
        return NULL;
    PyObject *keys = args[0];
    long long high;
    long shift;
    if (table_args(args, "rows", &high, &shift) < 0)
        return NULL;
    /* the keys are checked after the conversions above (an __index__ may change the list) and
     * no Python code runs between this check and their use */
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (!keys16(keys))
        return PyLong_FromLong(-1);
    Py_buffer bs, bt, bp, bo;
    static const int at[4] = {1, 2, 3, 6};
    static const char writable[4] = {0, 0, 0, 1};
    Py_buffer *const bufs[4] = {&bs, &bt, &bp, &bo};
    if (get_bufs(args, 4, at, "iBKq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t nslots = bs.len / 4, nrows = bp.len / WIDTH;
    if (bo.len < (n + 2) * 8 || !table_ok(nslots, bt.len, shift, high, nrows)) {
        PyErr_SetString(PyExc_ValueError, "rows(): buffers do not match the table");
        goto done;
    }
    {
        res = PyLong_FromSsize_t(rows_core(keys, n, (const int32_t *)bs.buf, (const uint8_t *)bt.buf,
                                           (const unsigned char *)bp.buf, nslots, nrows, shift, high,
                                           (int64_t *)bo.buf));
    }
done:
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bt);
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bo);
    return res;
}

/* ------------------------------------------------------------------------------------ lead */

#define MAX_TW 64 /* 4 tiers x up to 16 words of 64 workers */

/* 0, or -1 with a ValueError set (a row outside the matrix) */
static int lead_core(const int64_t *rows, Py_ssize_t m, const uint64_t *bits, Py_ssize_t nrows, Py_ssize_t nwords,
                     const uint64_t *table, Py_ssize_t n_workers, int remote, int64_t *out) {
    Py_ssize_t ww = (n_workers + 63) / 64, tw = 4 * ww;
    uint64_t alive[MAX_TW], got[MAX_TW];
    for (Py_ssize_t k = 0; k < tw; k++)
        alive[k] = ~(uint64_t)0;
    const uint64_t *prow = bits + (size_t)(nrows - 1) * nwords; /* rows[0] is -1: the empty last row */
    for (Py_ssize_t i = 0; i <= m; i++) {
        int64_t r = rows[i + 1];
        if (r < 0)
            r += nrows;
        if (r < 0 || r >= nrows) {
            PyErr_SetString(PyExc_ValueError, "lead(): a row outside the matrix");
            return -1;
        }
        const uint64_t *row = bits + (size_t)r * nwords;
        if (memcmp(row, prow, nwords * 8) == 0)
            continue; /* the same segment */
        prow = row;
        /* a new segment starts at key i: the OR of its bytes' table entries */
        for (Py_ssize_t k = 0; k < tw; k++)
            got[k] = 0;
        const unsigned char *bytes = (const unsigned char *)row;
        for (Py_ssize_t b = 0; b < nwords * 8; b++) {
            unsigned v = bytes[b];
            if (!v)
                continue; /* no set column: all clear in the table */
            const uint64_t *col = table + (b * 256 + v) * tw; /* one cache line for up to 64 workers */
            for (Py_ssize_t k = 0; k < tw; k++)
                got[k] |= col[k];
        }
        int any = 0;
        for (Py_ssize_t k = 0; k < tw; k++) {
            uint64_t dying = alive[k] & ~got[k];
            alive[k] &= got[k];
            any |= alive[k] != 0;
            while (dying) {
                int bit = __builtin_ctzll(dying);
                dying &= dying - 1;
                Py_ssize_t t = k / ww, w = (k % ww) * 64 + bit;
                if (w < n_workers)
                    out[t * n_workers + w] = i;
            }
        }
        if (!any)
            break; /* the row -1 after the last key ends every run, so every worker is set */
    }
    if (!remote)
        memcpy(out + 3 * n_workers, out + 2 * n_workers, n_workers * 8);
    return 0;
}

static PyObject *route_lead(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 8, "lead"))
        return NULL;
    Py_ssize_t m = PyLong_AsSsize_t(args[1]);
    Py_ssize_t nwords = PyLong_AsSsize_t(args[3]);
    Py_ssize_t n_workers = PyLong_AsSsize_t(args[5]);
    int remote = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || remote < 0)
        return NULL;
    Py_buffer br, bb, bt, bo;
    static const int at[4] = {0, 2, 4, 7};
    static const char writable[4] = {0, 0, 0, 1};
    Py_buffer *const bufs[4] = {&br, &bb, &bt, &bo};
    if (get_bufs(args, 4, at, "qQQq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    /* bounds first, so no size below overflows (m, nwords and n_workers are the caller's) */
    if (m <= 0 || m > br.len / 8 - 2 || nwords <= 0 || nwords > bb.len / 8 || n_workers <= 0 ||
        n_workers > MAX_TW / 4 * 64 || bo.len / 8 / 4 < n_workers) {
        PyErr_SetString(PyExc_ValueError, "lead(): buffers do not match the plan");
        goto done;
    }
    Py_ssize_t tw = 4 * ((n_workers + 63) / 64), stride = nwords * 8 * 256, nrows = bb.len / 8 / nwords;
    if (bt.len / 8 / tw != stride || bt.len % (8 * tw)) {
        PyErr_SetString(PyExc_ValueError, "lead(): buffers do not match the plan");
        goto done;
    }
    if (lead_core((const int64_t *)br.buf, m, (const uint64_t *)bb.buf, nrows, nwords, (const uint64_t *)bt.buf,
                  n_workers, remote, (int64_t *)bo.buf) == 0) {
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    PyBuffer_Release(&br);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bt);
    PyBuffer_Release(&bo);
    return res;
}

/* ---------------------------------------------------------------------------------- sparse */

/* One walk (sparse.walk): from start - 1, over the positions whose word (every step-th of h)
 * has bit set, in steps of at most k; one past the last position reached. */
static inline int64_t walk_bits(const uint64_t *h, Py_ssize_t step, uint64_t bit, Py_ssize_t n, int64_t k,
                                int64_t start) {
    int64_t last = start - 1;
    for (int64_t i = start; i < n && i - last <= k; i++)
        if (h[(size_t)i * step] & bit)
            last = i;
    return last + 1;
}

/* sparse()'s work on checked buffers: 0, or -1 with an exception set (a row outside the
 * matrix, no memory) */
static int sparse_core(const int64_t *rows, Py_ssize_t n, const uint64_t *bits, Py_ssize_t nrows, Py_ssize_t nwords,
                       const uint64_t *table, Py_ssize_t n_workers, int64_t kh, int64_t kany, int64_t *lead) {
    Py_ssize_t ww = (n_workers + 63) / 64, tw = 4 * ww, hw = 2 * ww;
    /* per key, the workers holding it in gpu or host (ww words), then anywhere of their own */
    uint64_t small[2 * 128], *held = small;
    if ((size_t)n * hw > sizeof(small) / sizeof(small[0])) {
        held = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)n * hw);
        if (!held) {
            PyErr_NoMemory();
            return -1;
        }
    }
    const uint64_t *prow = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *h = held + (size_t)i * hw;
        int64_t r = rows[i + 1];
        if (r < 0)
            r = 0; /* not indexed: the empty padding row */
        if (r >= nrows) {
            PyErr_SetString(PyExc_ValueError, "sparse(): a row outside the matrix");
            if (held != small)
                free(held);
            return -1;
        }
        const uint64_t *row = bits + (size_t)r * nwords;
        if (prow && (row == prow || memcmp(row, prow, nwords * 8) == 0)) {
            memcpy(h, h - hw, hw * 8); /* held alike */
            continue;
        }
        prow = row;
        memset(h, 0, hw * 8);
        const unsigned char *bytes = (const unsigned char *)row;
        for (Py_ssize_t b = 0; b < nwords * 8; b++) {
            unsigned v = bytes[b];
            if (!v)
                continue;
            const uint64_t *col = table + (b * 256 + v) * tw; /* tiers 1 (gpu or host), 2 (own tiers) */
            for (Py_ssize_t k = 0; k < hw; k++)
                h[k] |= col[ww + k];
        }
    }
    int64_t *d0 = lead, *d1 = lead + n_workers, *d2 = lead + 2 * n_workers, *d3 = lead + 3 * n_workers;
    for (Py_ssize_t j = 0; j < n_workers; j++) {
        uint64_t bit = (uint64_t)1 << (j & 63);
        const uint64_t *h = held + (j >> 6);
        int64_t host = walk_bits(h, hw, bit, n, kh, d0[j]);
        if (host < d1[j])
            host = d1[j];
        int64_t any = walk_bits(h + ww, hw, bit, n, kany, host);
        if (any < d2[j])
            any = d2[j];
        d1[j] = host;
        d2[j] = any;
        if (d3[j] < any)
            d3[j] = any;
    }
    if (held != small)
        free(held);
    return 0;
}

static PyObject *route_sparse(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 9, "sparse"))
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    Py_ssize_t nwords = PyLong_AsSsize_t(args[3]);
    Py_ssize_t n_workers = PyLong_AsSsize_t(args[5]);
    long long kh = PyLong_AsLongLong(args[6]);
    long long kany = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer br, bb, bt, bo;
    static const int at[4] = {0, 2, 4, 8};
    static const char writable[4] = {0, 0, 0, 1};
    Py_buffer *const bufs[4] = {&br, &bb, &bt, &bo};
    if (get_bufs(args, 4, at, "qQQq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    /* bounds first, so no size below overflows (n, nwords and n_workers are the caller's) */
    if (n < 0 || n > br.len / 8 - 2 || nwords <= 0 || nwords > bb.len / 8 || n_workers <= 0 ||
        n_workers > MAX_TW / 4 * 64 || bo.len / 8 / 4 != n_workers || bo.len % 32 || kh < 1 || kany < kh) {
        PyErr_SetString(PyExc_ValueError, "sparse(): buffers do not match the plan");
        goto done;
    }
    Py_ssize_t tw = 4 * ((n_workers + 63) / 64), stride = nwords * 8 * 256, nrows = bb.len / 8 / nwords;
    if (bt.len / 8 / tw != stride || bt.len % (8 * tw)) {
        PyErr_SetString(PyExc_ValueError, "sparse(): buffers do not match the plan");
        goto done;
    }
    {
        int64_t *lead = (int64_t *)bo.buf;
        for (Py_ssize_t j = 0; j < 4 * n_workers; j++)
            if (lead[j] < 0 || lead[j] > n) {
                PyErr_SetString(PyExc_ValueError, "sparse(): a lead outside the keys");
                goto done;
            }
    }
    if (sparse_core((const int64_t *)br.buf, n, (const uint64_t *)bb.buf, nrows, nwords, (const uint64_t *)bt.buf,
                    n_workers, kh, kany, (int64_t *)bo.buf) == 0) {
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    PyBuffer_Release(&br);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bt);
    PyBuffer_Release(&bo);
    return res;
}

/* ----------------------------------------------------------------------------- sparse_cols */

/* One worker's walk (sparse.walk) over a bit mask of the positions it holds (pw words): from
 * start, from held position to held position in steps of at most k counted from start - 1; one
 * past the last position reached (start when none). */
static long long walk_mask(const uint64_t *mask, Py_ssize_t pw, Py_ssize_t n, long long k, long long start) {
    long long last = start - 1, p = start;
    while (p < n) {
        Py_ssize_t w = (Py_ssize_t)(p >> 6);
        uint64_t x = mask[w] & (~(uint64_t)0 << (p & 63));
        while (!x && ++w < pw)
            x = mask[w];
        if (!x)
            break;
        long long q = (long long)w * 64 + __builtin_ctzll(x);
        if (q >= n || q - last > k)
            break;
        last = q;
        p = q + 1;
    }
    return last + 1;
}

/* Per column c of the matrix, the positions p < n whose row (rows[p + 1]; < 0: none) has it:
 * pw words of bits at masks + c * pw; then `extra` more zeroed masks. NULL: no memory. */
static uint64_t *column_masks(const int64_t *rows, Py_ssize_t n, const uint64_t *bits, Py_ssize_t nwords,
                              Py_ssize_t pw, Py_ssize_t extra) {
    uint64_t *cm = (uint64_t *)calloc((size_t)(nwords * 64 + extra) * (size_t)pw, sizeof(uint64_t));
    if (cm == NULL)
        return NULL;
    for (Py_ssize_t p = 0; p < n; p++) {
        int64_t r = rows[p + 1];
        if (r < 0)
            continue;
        const uint64_t *row = bits + (size_t)r * (size_t)nwords;
        for (Py_ssize_t w = 0; w < nwords; w++)
            for (uint64_t x = row[w]; x; x &= x - 1)
                cm[(size_t)(w * 64 + __builtin_ctzll(x)) * pw + (p >> 6)] |= (uint64_t)1 << (p & 63);
    }
    return cm;
}

/* Whether every one of count values lies in [lo, hi); else a ValueError "fn(): what". */
static int all_within(const int64_t *v, Py_ssize_t count, int64_t lo, int64_t hi, const char *fn, const char *what) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (v[i] < lo || v[i] >= hi) {
            PyErr_Format(PyExc_ValueError, "%s(): %s", fn, what);
            return 0;
        }
    return 1;
}

/* The first position below m whose bit is clear in mask (m when none). */
static long long first_clear(const uint64_t *mask, Py_ssize_t m) {
    for (Py_ssize_t w = 0; w * 64 < m; w++) {
        uint64_t x = ~mask[w];
        if (x) {
            long long q = (long long)w * 64 + __builtin_ctzll(x);
            return q < m ? q : m;
        }
    }
    return m;
}

static PyObject *route_lead_cols(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 9, "lead_cols"))
        return NULL;
    Py_ssize_t m = PyLong_AsSsize_t(args[1]);
    Py_ssize_t nwords = PyLong_AsSsize_t(args[3]);
    int remote = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred() || remote < 0)
        return NULL;
    Py_buffer br, bb, bc, bs, bm, bo;
    static const int at[6] = {0, 2, 4, 5, 6, 8};
    static const char writable[6] = {0, 0, 0, 0, 0, 1};
    Py_buffer *const bufs[6] = {&br, &bb, &bc, &bs, &bm, &bo};
    if (get_bufs(args, 6, at, "qQqqQq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t n_workers = bs.len / 8, nmasks = nwords > 0 ? bm.len / 8 / nwords : 0;
    if (m < 0 || m > br.len / 8 - 2 || nwords <= 0 || nwords > bb.len / 8 || bc.len / 8 != 5 * n_workers ||
        bo.len / 8 != 4 * n_workers || bm.len / 8 != nmasks * nwords) {
        PyErr_SetString(PyExc_ValueError, "lead_cols(): buffers do not match the plan");
        goto done;
    }
    {
        const int64_t *rows = (const int64_t *)br.buf, *fast = (const int64_t *)bc.buf, *rsel = (const int64_t *)bs.buf;
        const uint64_t *bits = (const uint64_t *)bb.buf, *rmask = (const uint64_t *)bm.buf;
        int64_t *lead = (int64_t *)bo.buf;
        if (!all_within(rows, m + 2, INT64_MIN, bb.len / 8 / nwords, "lead_cols", "a row outside the matrix") ||
            !all_within(fast, 5 * n_workers, 0, nwords * 64, "lead_cols", "a column outside the matrix") ||
            (remote && !all_within(rsel, n_workers, 0, nmasks, "lead_cols", "a remote mask outside the masks")))
            goto done;
        Py_ssize_t pw = (m + 63) / 64 + 1;
        /* the masks of the columns, then per remote mask the OR of its columns', then three of a worker */
        uint64_t *cm = column_masks(rows, m, bits, nwords, pw, (remote ? nmasks : 0) + 3);
        if (cm == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        uint64_t *rm = cm + (size_t)nwords * 64 * pw, *g = rm + (size_t)(remote ? nmasks : 0) * pw, *h = g + pw,
                 *a = h + pw;
        for (Py_ssize_t k = 0; remote && k < nmasks; k++)
            for (Py_ssize_t w = 0; w < nwords; w++)
                for (uint64_t x = rmask[k * nwords + w]; x; x &= x - 1) {
                    const uint64_t *col = cm + (size_t)(w * 64 + __builtin_ctzll(x)) * pw;
                    for (Py_ssize_t q = 0; q < pw; q++)
                        rm[k * pw + q] |= col[q];
                }
        for (Py_ssize_t j = 0; j < n_workers; j++) {
            const uint64_t *c[5];
            for (int t = 0; t < 5; t++)
                c[t] = cm + (size_t)fast[t * n_workers + j] * pw;
            for (Py_ssize_t w = 0; w < pw; w++) {
                g[w] = c[0][w] | c[1][w] | c[2][w];
                h[w] = g[w] | c[3][w];
                a[w] = h[w] | c[4][w];
            }
            lead[j] = first_clear(g, m);
            lead[n_workers + j] = first_clear(h, m);
            lead[2 * n_workers + j] = first_clear(a, m);
            if (remote) {
                const uint64_t *r = rm + (size_t)rsel[j] * pw;
                for (Py_ssize_t w = 0; w < pw; w++)
                    a[w] |= r[w];
                lead[3 * n_workers + j] = first_clear(a, m);
            } else
                lead[3 * n_workers + j] = lead[2 * n_workers + j];
        }
        free(cm);
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    for (int j = 0; j < 6; j++)
        PyBuffer_Release(bufs[j]);
    return res;
}

static PyObject *route_sparse_cols(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 9, "sparse_cols"))
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    Py_ssize_t nwords = PyLong_AsSsize_t(args[3]);
    Py_ssize_t n_workers = PyLong_AsSsize_t(args[5]);
    long long kh = PyLong_AsLongLong(args[6]);
    long long kany = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer br, bb, bc, bo;
    static const int at[4] = {0, 2, 4, 8};
    static const char writable[4] = {0, 0, 0, 1};
    Py_buffer *const bufs[4] = {&br, &bb, &bc, &bo};
    if (get_bufs(args, 4, at, "qQqq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    if (n < 0 || n > br.len / 8 - 2 || nwords <= 0 || nwords > bb.len / 8 || n_workers < 0 ||
        bc.len / 8 != 5 * n_workers || bo.len / 8 != 4 * n_workers || kh < 1 || kany < kh) {
        PyErr_SetString(PyExc_ValueError, "sparse_cols(): buffers do not match the plan");
        goto done;
    }
    {
        const int64_t *rows = (const int64_t *)br.buf, *fast = (const int64_t *)bc.buf;
        const uint64_t *bits = (const uint64_t *)bb.buf;
        int64_t *lead = (int64_t *)bo.buf;
        if (!all_within(rows, n + 2, INT64_MIN, bb.len / 8 / nwords, "sparse_cols", "a row outside the matrix") ||
            !all_within(fast, 5 * n_workers, 0, nwords * 64, "sparse_cols", "a column outside the matrix") ||
            !all_within(lead, 4 * n_workers, 0, n + 1, "sparse_cols", "a lead outside the keys"))
            goto done;
        /* per column, the positions whose row has it (pw words of bits), from each row's set
         * bits; then each worker's masks are the OR of its columns' */
        Py_ssize_t pw = (n + 63) / 64 + 1;
        uint64_t *cm = column_masks(rows, n, bits, nwords, pw, 2);
        if (cm == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        uint64_t *hm = cm + (size_t)nwords * 64 * pw, *am = hm + pw;
        for (Py_ssize_t j = 0; j < n_workers; j++) {
            /* the worker's columns: gpu, speculative 0 and 1, host (in gpu or host), then disk */
            const uint64_t *c[5];
            for (int t = 0; t < 5; t++)
                c[t] = cm + (size_t)fast[t * n_workers + j] * pw;
            for (Py_ssize_t w = 0; w < pw; w++) {
                hm[w] = c[0][w] | c[1][w] | c[2][w] | c[3][w];
                am[w] = hm[w] | c[4][w];
            }
            long long got = walk_mask(hm, pw, n, kh, lead[j]);
            long long d_host = lead[n_workers + j] > got ? lead[n_workers + j] : got;
            got = walk_mask(am, pw, n, kany, d_host);
            long long d_any = lead[2 * n_workers + j] > got ? lead[2 * n_workers + j] : got;
            lead[n_workers + j] = d_host;
            lead[2 * n_workers + j] = d_any;
            if (lead[3 * n_workers + j] < d_any)
                lead[3 * n_workers + j] = d_any;
        }
        free(cm);
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    PyBuffer_Release(&br);
    PyBuffer_Release(&bb);
    PyBuffer_Release(&bc);
    PyBuffer_Release(&bo);
    return res;
}

/* ------------------------------------------------------------------------------------ rank */

typedef struct {
    double cost, queued, active;
    uint64_t tie;
    Py_ssize_t i;
} Entry;

static inline int before(const Entry *a, const Entry *b) {
    if (a->cost != b->cost)
        return a->cost < b->cost;
    if (a->queued != b->queued)
        return a->queued < b->queued;
    if (a->active != b->active)
        return a->active < b->active;
    if (a->tie != b->tie)
        return a->tie < b->tie;
    return a->i < b->i;
}

static int cmp_entry(const void *x, const void *y) {
    const Entry *a = (const Entry *)x, *b = (const Entry *)y;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* the cost, saved and order (a list of the best top_k; NULL with an exception set) */
static PyObject *rank_core(double n, const int64_t *lead, const double *wt, const double *lc, const double *q,
                           const double *a, const uint64_t *dig, uint64_t kd, Py_ssize_t w, Py_ssize_t top_k,
                           int pairwise, double *cost, double *saved) {
    Py_ssize_t k = top_k < 0 ? w : (top_k < w ? top_k : w);
    Entry small[128];
    Entry *e = w <= 128 ? small : (Entry *)malloc(sizeof(Entry) * w);
    if (!e)
        return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < w; j++) {
        double p0 = (double)lead[j] * wt[j], p1 = (double)lead[w + j] * wt[w + j];
        double p2 = (double)lead[2 * w + j] * wt[2 * w + j], p3 = (double)lead[3 * w + j] * wt[3 * w + j];
        /* as numpy's einsum adds them: in tier order, except where the tiers of a worker's
         * weights were adjacent in memory (one worker, or a selection of workers' columns):
         * then as one contiguous sum of 4 in two lanes */
        double s = pairwise ? (p0 + p2) + (p1 + p3) : ((p0 + p1) + p2) + p3;
        double c = n - s;
        c = c + lc[j];
        saved[j] = s;
        cost[j] = c;
        e[j].cost = rint(c * 1e9) / 1e9; /* numpy's round(cost, 9) */
        e[j].queued = q[j];
        e[j].active = a[j];
        e[j].tie = (dig[j] ^ kd) * MIX1;
        e[j].i = j;
    }
    if (k == 0) { /* none wanted (top_k 0, or no workers): e[k - 1] below would be e[-1] */
    } else if (k <= 16) { /* the best k by insertion: e[0..k) sorted (writes stay at or below the read) */
        Py_ssize_t have = 0;
        for (Py_ssize_t j = 0; j < w; j++) {
            Entry x = e[j];
            if (have == k && !before(&x, &e[k - 1]))
                continue;
            Py_ssize_t p = have < k ? have++ : k - 1;
            while (p > 0 && before(&x, &e[p - 1])) {
                e[p] = e[p - 1];
                p--;
            }
            e[p] = x;
        }
    } else {
        qsort(e, w, sizeof(Entry), cmp_entry);
    }
    PyObject *res = PyList_New(k);
    for (Py_ssize_t j = 0; res && j < k; j++) {
        PyObject *v = PyLong_FromSsize_t(e[j].i);
        if (!v)
            Py_CLEAR(res);
        else
            PyList_SET_ITEM(res, j, v);
    }
    if (e != small)
        free(e);
    return res;
}

static PyObject *route_rank(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 12, "rank"))
        return NULL;
    int pairwise = PyObject_IsTrue(args[11]);
    if (pairwise < 0)
        return NULL;
    double n = PyFloat_AsDouble(args[0]);
    unsigned long long kd = PyLong_AsUnsignedLongLongMask(args[7]);
    Py_ssize_t top_k = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer b[9];
    int idx[9] = {1, 2, 3, 4, 5, 6, 9, 10, -1};
    static const char kinds[8] = {'q', 'd', 'd', 'd', 'd', 'Q', 'd', 'd'};
    int got = 0;
    for (; got < 8; got++) {
        if (get_buf(args[idx[got]], &b[got], got >= 6, kinds[got]) < 0)
            break;
    }
    PyObject *res = NULL;
    if (got < 8)
        goto done;
    Py_ssize_t w = b[3].len / 8;
    if (b[0].len != 4 * w * 8 || b[1].len != 4 * w * 8 || b[2].len != w * 8 || b[4].len != w * 8 ||
        b[5].len != w * 8 || b[6].len != w * 8 || b[7].len != w * 8) {
        PyErr_SetString(PyExc_ValueError, "rank(): arrays of different lengths");
        goto done;
    }
    res = rank_core(n, (const int64_t *)b[0].buf, (const double *)b[1].buf, (const double *)b[2].buf,
                    (const double *)b[3].buf, (const double *)b[4].buf, (const uint64_t *)b[5].buf, (uint64_t)kd, w,
                    top_k, pairwise, (double *)b[6].buf, (double *)b[7].buf);
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return res;
}

/* ---------------------------------------------------------------------------------- insert */

static PyObject *route_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 7, "insert"))
        return NULL;
    PyObject *keys = args[0];
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "insert(): keys must be a list");
        return NULL;
    }
    long shift = PyLong_AsLong(args[6]);
    if (shift == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys); /* checked after the conversion: an __index__ may change it */
    if (!keys16(keys))
        return PyLong_FromLong(-1);
    Py_buffer b[5];
    static const char kinds[5] = {'q', 'K', 'B', 'i', 'B'};
    int got = 0;
    for (; got < 5; got++)
        if (get_buf(args[got + 1], &b[got], got >= 1, kinds[got]) < 0)
            break;
    PyObject *res = NULL;
    if (got < 5)
        goto done;
    Py_ssize_t nrows = b[1].len / WIDTH, nslots = b[3].len / 4;
    if (b[0].len < n * 8 || b[2].len < nrows || b[4].len < nslots || nslots < 16 || (nslots & (nslots - 1)) ||
        shift < 9 || shift > 63 || ((uint64_t)1 << (64 - shift)) != (uint64_t)nslots || nslots > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "insert(): buffers do not match the table");
        goto done;
    }
    {
        const int64_t *rows = (const int64_t *)b[0].buf;
        unsigned char *packed = (unsigned char *)b[1].buf;
        uint8_t *live = (uint8_t *)b[2].buf;
        int32_t *slots = (int32_t *)b[3].buf;
        uint8_t *tags = (uint8_t *)b[4].buf;
        uint64_t mask = (uint64_t)nslots - 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (rows[i] < 0 || rows[i] >= nrows || rows[i] > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "insert(): a row outside the table");
                goto done;
            }
        int placed = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, i));
            memcpy(packed + (size_t)rows[i] * WIDTH, key, WIDTH);
            live[rows[i]] = 1;
        }
        for (Py_ssize_t i = 0; i < n && placed; i++) /* each in the first free slot from its home */
            placed = place_one(packed + (size_t)rows[i] * WIDTH, (int32_t)rows[i], slots, tags, mask, shift);
        res = PyLong_FromLong(placed);
    }
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return res;
}

static PyObject *route_place(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 5, "place"))
        return NULL;
    long shift = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer b[4];
    int got = 0;
    static const char kinds[4] = {'q', 'K', 'i', 'B'};
    for (; got < 4; got++)
        if (get_buf(args[got], &b[got], got >= 2, kinds[got]) < 0)
            break;
    PyObject *res = NULL;
    if (got < 4)
        goto done;
    Py_ssize_t n = b[0].len / 8, nrows = b[1].len / WIDTH, nslots = b[2].len / 4;
    if (b[3].len < nslots || nslots < 16 || (nslots & (nslots - 1)) || shift < 9 || shift > 63 ||
        ((uint64_t)1 << (64 - shift)) != (uint64_t)nslots || nslots > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "place(): buffers do not match the table");
        goto done;
    }
    {
        const int64_t *rows = (const int64_t *)b[0].buf;
        const unsigned char *packed = (const unsigned char *)b[1].buf;
        int32_t *slots = (int32_t *)b[2].buf;
        uint8_t *tags = (uint8_t *)b[3].buf;
        uint64_t mask = (uint64_t)nslots - 1;
        int placed = 1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (rows[i] < 0 || rows[i] >= nrows || rows[i] > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "place(): a row outside the table");
                goto done;
            }
        for (Py_ssize_t i = 0; i < n && placed; i++) {
            if (i + AHEAD < n) {
                const unsigned char *ka = packed + (size_t)rows[i + AHEAD] * WIDTH;
                uint64_t a0, a1;
                memcpy(&a0, ka, 8);
                memcpy(&a1, ka + 8, 8);
                uint64_t ha = ((a0 * C1) ^ a1) * C2;
                uint64_t b1 = bucket1(ha, shift), b2 = bucket2(ha, shift);
                __builtin_prefetch(tags + b1, 1);
                __builtin_prefetch(tags + b2, 1);
            }
            placed = place_one(packed + (size_t)rows[i] * WIDTH, (int32_t)rows[i], slots, tags, mask, shift);
        }
        res = PyLong_FromLong(placed);
    }
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return res;
}

/* ------------------------------------------------------------------------------------ fill */

/* fill()'s work on checked buffers (rows: one per key); returns the status, *made, *high and
 * *nfree updated; -1 with a ValueError set for a free row outside the index */
static int fill_core(PyObject *keys, Py_ssize_t n, int64_t *rows, int32_t *slots, uint8_t *tags, unsigned char *packed,
                     Py_ssize_t nkeys, uint8_t *live, uint64_t *bits, Py_ssize_t nwords, Py_ssize_t cap,
                     const int64_t *free_rows, Py_ssize_t *nfree, Py_ssize_t *high, uint64_t mask, long shift,
                     Py_ssize_t col, int fresh, Py_ssize_t *made) {
    int status = 1;
    /* fresh: this call's new keys by hash (open addressing, -1: empty), instead of a probe of
     * the table's two buckets for each */
    int64_t *seen = NULL;
    uint64_t smask = 0;
    if (fresh) {
        Py_ssize_t missing = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            missing += rows[i] < 0;
        uint64_t size = 16;
        while (size < 2 * (uint64_t)missing)
            size *= 2;
        seen = (int64_t *)malloc(size * 8);
        if (seen) {
            memset(seen, 0xff, size * 8);
            smask = size - 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n && rows[i + AHEAD] < 0) { /* a new key's two buckets, fetched AHEAD keys on */
            uint64_t h = key_hash((const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, i + AHEAD)));
            uint64_t b1 = bucket1(h, shift), b2 = bucket2(h, shift);
            __builtin_prefetch(tags + b1, 1);
            __builtin_prefetch(tags + b2, 1);
        }
        if (rows[i] >= 0)
            continue;
        const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, i));
        int64_t r = -1;
        uint64_t at = 0;
        if (seen) { /* given earlier in this call: one of its keys */
            for (at = key_hash(key) & smask; seen[at] >= 0; at = (at + 1) & smask)
                if (memcmp(PyBytes_AS_STRING(PyList_GET_ITEM(keys, seen[at])), key, WIDTH) == 0) {
                    r = rows[seen[at]];
                    break;
                }
        } else
            r = probe(slots, tags, packed, nkeys, mask, (int)shift, key); /* given earlier in this call */
        if (r >= 0) {
            rows[i] = r;
            continue;
        }
        if (*nfree) {
            r = free_rows[--*nfree];
            if (r < 1 || r >= cap - 1) {
                PyErr_SetString(PyExc_ValueError, "fill(): a free row outside the index");
                free(seen);
                return -1;
            }
        } else if (*high < cap - 1) /* the last row stays empty: row -1 reads as "no key" */
            r = (*high)++;
        else {
            status = 2; /* the matrix must grow */
            break;
        }
        memcpy(packed + (size_t)r * WIDTH, key, WIDTH);
        live[r] = 1;
        bits[(size_t)r * nwords] |= (uint64_t)1; /* ALWAYS */
        rows[i] = r;
        if (seen)
            seen[at] = i;
        ++*made;
        if (!place_one(key, (int32_t)r, slots, tags, mask, shift)) {
            status = 0; /* stored and live, not placed: the table must be rebuilt bigger */
            break;
        }
    }
    free(seen);
    if (status == 1 && col >= 0) {
        uint64_t bit = (uint64_t)1 << (col & 63);
        for (Py_ssize_t i = 0; i < n; i++)
            bits[(size_t)rows[i] * nwords + (col >> 6)] |= bit;
    }
    return status;
}

static PyObject *route_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14 && !nargs_ok(nargs, 13, "fill"))
        return NULL;
    int fresh = nargs == 14 ? PyObject_IsTrue(args[13]) : 0;
    if (fresh < 0)
        return NULL;
    PyObject *keys = args[0];
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "fill(): keys must be a list");
        return NULL;
    }
    Py_ssize_t nwords = PyLong_AsSsize_t(args[7]);
    Py_ssize_t nfree = PyLong_AsSsize_t(args[9]);
    Py_ssize_t high = PyLong_AsSsize_t(args[10]);
    long shift = PyLong_AsLong(args[11]);
    Py_ssize_t col = PyLong_AsSsize_t(args[12]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys); /* checked after the conversions: an __index__ may change it */
    if (!keys16(keys))
        Py_RETURN_NONE;
    Py_buffer b[7];
    static const int at[7] = {1, 2, 3, 4, 5, 6, 8};
    static const char kinds[7] = {'q', 'i', 'B', 'K', 'B', 'Q', 'q'};
    int got = 0;
    for (; got < 7; got++)
        if (get_buf(args[at[got]], &b[got], got < 6, kinds[got]) < 0)
            break;
    PyObject *res = NULL;
    if (got < 7)
        goto done;
    Py_ssize_t nslots = b[1].len / 4, nkeys = b[3].len / WIDTH;
    Py_ssize_t cap = nwords > 0 ? b[5].len / 8 / nwords : 0;
    if (b[0].len < n * 8 || b[2].len < nslots || nslots < 16 || (nslots & (nslots - 1)) || shift < 9 || shift > 63 ||
        ((uint64_t)1 << (64 - shift)) != (uint64_t)nslots || nslots > INT32_MAX || nwords <= 0 || cap < 2 ||
        nkeys < cap || b[4].len < cap || cap > INT32_MAX || high < 1 || high > cap - 1 || nfree < 0 ||
        nfree > b[6].len / 8 || col < -1 || col / 64 >= nwords) {
        PyErr_SetString(PyExc_ValueError, "fill(): buffers do not match the index");
        goto done;
    }
    {
        int64_t *rows = (int64_t *)b[0].buf;
        int32_t *slots = (int32_t *)b[1].buf;
        uint8_t *tags = (uint8_t *)b[2].buf;
        unsigned char *packed = (unsigned char *)b[3].buf;
        uint8_t *live = (uint8_t *)b[4].buf;
        uint64_t *bits = (uint64_t *)b[5].buf;
        const int64_t *free_rows = (const int64_t *)b[6].buf;
        uint64_t mask = (uint64_t)nslots - 1;
        Py_ssize_t made = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (rows[i] >= cap) {
                PyErr_SetString(PyExc_ValueError, "fill(): a row outside the index");
                goto done;
            }
        int status = fill_core(keys, n, rows, slots, tags, packed, nkeys, live, bits, nwords, cap, free_rows, &nfree,
                               &high, mask, shift, col, fresh, &made);
        if (status < 0)
            goto done;
        res = Py_BuildValue("(innn)", status, made, high, nfree);
    }
done:
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return res;
}

/* --------------------------------------------------------------------------------- set_bit */

static PyObject *route_set_bit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 5, "set_bit"))
        return NULL;
    Py_ssize_t nwords = PyLong_AsSsize_t(args[1]);
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    Py_ssize_t col = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer bb, br;
    static const int at[2] = {0, 2};
    static const char writable[2] = {1, 0};
    Py_buffer *const bufs[2] = {&bb, &br};
    if (get_bufs(args, 2, at, "Qq", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t nrows = nwords > 0 ? bb.len / 8 / nwords : 0;
    if (nwords <= 0 || nwords > bb.len / 8 || col < 0 || col / 64 >= nwords || count < 0 || count > br.len / 8) {
        PyErr_SetString(PyExc_ValueError, "set_bit(): arguments do not match the matrix");
        goto done;
    }
    {
        uint64_t *bits = (uint64_t *)bb.buf;
        const int64_t *rows = (const int64_t *)br.buf;
        uint64_t bit = (uint64_t)1 << (col & 63);
        Py_ssize_t word = col >> 6;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (rows[i] < 0 || rows[i] >= nrows) {
                PyErr_SetString(PyExc_ValueError, "set_bit(): a row outside the matrix");
                goto done;
            }
        }
        for (Py_ssize_t i = 0; i < count; i++)
            bits[(size_t)rows[i] * nwords + word] |= bit;
        Py_INCREF(Py_None);
        res = Py_None;
    }
done:
    PyBuffer_Release(&bb);
    PyBuffer_Release(&br);
    return res;
}

/* ----------------------------------------------------------------------------------- unset */

static PyObject *route_unset(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!nargs_ok(nargs, 9, "unset"))
        return NULL;
    PyObject *keys = args[0];
    long long high;
    long shift;
    if (table_args(args, "unset", &high, &shift) < 0)
        return NULL;
    Py_ssize_t nwords = PyLong_AsSsize_t(args[7]);
    Py_ssize_t col = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred())
        return NULL;
    /* the keys are checked after the conversions above (an __index__ may change the list) */
    if (!keys16(keys))
        return PyLong_FromLong(-1);
    Py_buffer bs, bt, bp, bb;
    static const int at[4] = {1, 2, 3, 6};
    static const char writable[4] = {0, 0, 0, 1};
    Py_buffer *const bufs[4] = {&bs, &bt, &bp, &bb};
    if (get_bufs(args, 4, at, "iBKQ", writable, bufs) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t nslots = bs.len / 4, nkeys = bp.len / WIDTH;
    Py_ssize_t nrows = nwords > 0 ? bb.len / 8 / nwords : 0;
    if (!table_ok(nslots, bt.len, shift, high, nkeys) || nwords <= 0 || nwords > bb.len / 8 || col < 0 ||
        col / 64 >= nwords) {
        PyErr_SetString(PyExc_ValueError, "unset(): buffers do not match the table");
        goto done;
    }
    {
        Py_ssize_t n = PyList_GET_SIZE(keys), found = 0;
        uint64_t mask = (uint64_t)nslots - 1, keep = ~((uint64_t)1 << (col & 63));
        uint64_t *bits = (uint64_t *)bb.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned char *key = (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, i));
            int64_t r = probe((const int32_t *)bs.buf, (const uint8_t *)bt.buf, (const unsigned char *)bp.buf, nkeys,
                              mask, (int)shift, key);
            if (r < 0)
                continue;
            if (r >= nrows) {
                PyErr_SetString(PyExc_ValueError, "unset(): a row outside the matrix");
                goto done;
            }
            bits[(size_t)r * nwords + (col >> 6)] &= keep;
            found++;
        }
        res = PyLong_FromSsize_t(found);
    }
done:
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bt);
    PyBuffer_Release(&bp);
    PyBuffer_Release(&bb);
    return res;
}

/* ---------------------------------------------------------------------------------- decide */

/* BLAKE2b (RFC 7693) with an 8-byte digest, no key, of a message of at most 128 bytes (one
 * block): scoring._digest64, the tie hash's digest of a request's last key. */
static const uint64_t B2_IV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                                  0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                                  0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2_G(a, b, c, d, x, y)                                                                                          \
    do {                                                                                                               \
        v[a] = v[a] + v[b] + (x);                                                                                      \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                                                \
        v[c] = v[c] + v[d];                                                                                            \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                                                \
        v[a] = v[a] + v[b] + (y);                                                                                      \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                                                \
        v[c] = v[c] + v[d];                                                                                            \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                                                \
    } while (0)

static uint64_t blake2b64(const unsigned char *data, size_t len) {
    unsigned char block[128] = {0};
    memcpy(block, data, len);
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) { /* little-endian words */
        uint64_t x = 0;
        for (int j = 7; j >= 0; j--)
            x = (x << 8) | block[8 * i + j];
        m[i] = x;
    }
    uint64_t h0 = B2_IV[0] ^ 0x01010000ULL ^ 8; /* depth 1, fanout 1, no key, 8-byte digest */
    for (int i = 0; i < 8; i++) {
        v[i] = i == 0 ? h0 : B2_IV[i];
        v[i + 8] = B2_IV[i];
    }
    v[12] ^= (uint64_t)len; /* the byte count; the only, so last, block */
    v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = B2_SIGMA[r];
        B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    return h0 ^ v[0] ^ v[8]; /* the digest's 8 bytes, read little-endian */
}

static PyObject *route_digest64(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyBytes_Check(arg) || PyBytes_GET_SIZE(arg) > 128) {
        PyErr_SetString(PyExc_TypeError, "digest64(): bytes of at most 128 bytes expected");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(blake2b64((const unsigned char *)PyBytes_AS_STRING(arg),
                                                 (size_t)PyBytes_GET_SIZE(arg)));
}

static PyObject *route_decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 21 && !nargs_ok(nargs, 20, "decide"))
        return NULL;
    int pairwise = nargs == 21 ? PyObject_IsTrue(args[20]) : 0;
    if (pairwise < 0)
        return NULL;
    PyObject *keys = args[0];
    long long high;
    long shift;
    if (table_args(args, "decide", &high, &shift) < 0)
        return NULL;
    Py_ssize_t nwords = PyLong_AsSsize_t(args[7]);
    if (nwords == -1 && PyErr_Occurred())
        return NULL;
    int remote = PyObject_IsTrue(args[9]);
    if (remote < 0)
        return NULL;
    long gen = PyLong_AsLong(args[12]);
    if (gen == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t top_k = PyLong_AsSsize_t(args[13]);
    if (top_k == -1 && PyErr_Occurred())
        return NULL;
    long long kh = PyLong_AsLongLong(args[18]);
    if (kh == -1 && PyErr_Occurred())
        return NULL;
    long long kany = PyLong_AsLongLong(args[19]);
    if (kany == -1 && PyErr_Occurred())
        return NULL;
    if (gen < -1 || gen > 1) {
        PyErr_SetString(PyExc_ValueError, "decide(): spec_gen must be -1, 0 or 1");
        return NULL;
    }
    if (kh < 0 || (kh == 0 && kany != 0) || (kh > 0 && kany < kh)) {
        PyErr_SetString(PyExc_ValueError, "decide(): strides must be 0, 0 (dense) or 1 <= kh <= kany");
        return NULL;
    }
    /* the keys are checked after the conversions above (an __index__ or __bool__ may change the
     * list) and no Python code runs between this check and their use */
    if (!keys16(keys))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    int dispatch = gen >= 0;
    /* buffers: slots tags packed bits table workers loads rows live free aux */
    static const int at[11] = {1, 2, 3, 6, 8, 10, 11, 14, 15, 16, 17};
    static const char kinds[11] = {'i', 'B', 'K', 'Q', 'Q', 'Q', 'd', 'q', 'B', 'q', 'q'};
    static const char written[11] = {1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1}; /* (when dispatching: new rows) */
    Py_buffer b[11];
    int got = 0;
    for (; got < 11; got++)
        if (get_buf(args[at[got]], &b[got], got == 7 || got == 10 || (dispatch && written[got]), kinds[got]) < 0)
            break;
    PyObject *res = NULL, *order = NULL, *arrays = NULL;
    if (got < 11)
        goto done;
    Py_ssize_t nslots = b[0].len / 4, nrows_keys = b[2].len / WIDTH;
    Py_ssize_t w = b[6].len / 8 / 3, tw = 4 * ((w + 63) / 64);
    /* nwords is the caller's: bounded by the matrix before any size is made of it */
    Py_ssize_t nrows = nwords > 0 ? b[3].len / 8 / nwords : 0, stride = nrows > 0 ? nwords * 8 * 256 : 0;
    if (!table_ok(nslots, b[1].len, shift, high, nrows_keys) || nwords <= 0 || nrows < 1 || w <= 0 ||
        tw > MAX_TW || b[4].len != tw * stride * 8 || b[5].len != 7 * w * 8 || b[6].len != 3 * w * 8 ||
        b[7].len < (n + 2) * 8 || b[10].len < 4 * 8) {
        PyErr_SetString(PyExc_ValueError, "decide(): buffers do not match the index or the workers");
        goto done;
    }
    arrays = PyBytes_FromStringAndSize(NULL, 8 * w * 8);
    if (!arrays)
        goto done;
    {
        int64_t *rows = (int64_t *)b[7].buf;
        double *cs = (double *)PyBytes_AS_STRING(arrays);
        int64_t *lead = (int64_t *)(cs + 4 * w);
        const double *wt = (const double *)b[5].buf, *q = (const double *)b[6].buf;
        const uint64_t *dig = (const uint64_t *)b[5].buf + 4 * w;
        Py_ssize_t m = rows_core(keys, n, (const int32_t *)b[0].buf, (const uint8_t *)b[1].buf,
                                 (const unsigned char *)b[2].buf, nslots, nrows_keys, shift, high, rows);
        if (m == 0)
            memset(lead, 0, 4 * w * 8);
        else if (lead_core(rows, m, (const uint64_t *)b[3].buf, nrows, nwords, (const uint64_t *)b[4].buf, w, remote,
                           lead) < 0)
            goto done;
        if (kh > 0 && sparse_core(rows, n, (const uint64_t *)b[3].buf, nrows, nwords, (const uint64_t *)b[4].buf, w,
                                  kh, kany, lead) < 0)
            goto done;
        const unsigned char *last = n ? (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, n - 1)) : ZERO;
        uint64_t kd = blake2b64(last, n ? WIDTH : 0);
        order = rank_core((double)n, lead, wt, q + 2 * w, q, q + w, dig, kd, w, top_k, pairwise || w == 1, cs, cs + w);
        if (!order)
            goto done;
        memcpy(cs + 2 * w, q, 2 * w * 8); /* the loads the decision saw: queued, active */
        double saved_best = 0.0;
        int fetch = 0, speculated = 0;
        if (PyList_GET_SIZE(order)) {
            Py_ssize_t best = PyLong_AsSsize_t(PyList_GET_ITEM(order, 0));
            saved_best = cs[w + best];
            fetch = wt[3 * w + best] > 0 && lead[3 * w + best] > lead[2 * w + best];
            if (dispatch && !fetch && n > 0) { /* the speculative entries */
                int64_t col = ((const int64_t *)b[5].buf)[(5 + gen) * w + best];
                uint64_t *bits = (uint64_t *)b[3].buf;
                if (col < 0 || col / 64 >= nwords) {
                    PyErr_SetString(PyExc_ValueError, "decide(): a speculative column outside the matrix");
                    goto done;
                }
                for (Py_ssize_t i = 1; i <= n; i++)
                    if (rows[i] >= nrows) {
                        PyErr_SetString(PyExc_ValueError, "decide(): a row outside the matrix");
                        goto done;
                    }
                if (m == n) { /* every key has a row */
                    uint64_t bit = (uint64_t)1 << (col & 63);
                    for (Py_ssize_t i = 1; i <= n; i++)
                        bits[(size_t)rows[i] * nwords + (col >> 6)] |= bit;
                    speculated = 1;
                } else { /* new rows for the keys not indexed, where there is room for all of them without
                          * growing the matrix or the table (fill()); else the caller speculates */
                    int64_t *aux = (int64_t *)b[10].buf;
                    Py_ssize_t nfree = (Py_ssize_t)aux[0], wide = (Py_ssize_t)aux[1], high_now = (Py_ssize_t)high,
                               made = 0, want = n - m;
                    if (nfree >= 0 && nfree <= b[9].len / 8 && wide >= 0 && nrows_keys >= nrows &&
                        b[8].len >= nrows && nrows <= INT32_MAX && high_now >= 1 && high_now <= nrows - 1 &&
                        nfree + (nrows - 1 - high_now) >= want && wide + want <= nslots / 8 * FILL_EIGHTHS) {
                        int st = fill_core(keys, n, rows + 1, (int32_t *)b[0].buf, (uint8_t *)b[1].buf,
                                           (unsigned char *)b[2].buf, nrows_keys, (uint8_t *)b[8].buf, bits, nwords,
                                           nrows, (const int64_t *)b[9].buf, &nfree, &high_now,
                                           (uint64_t)nslots - 1, shift, col, 0, &made);
                        if (st < 0)
                            goto done;
                        aux[0] = nfree;
                        aux[1] = made;
                        aux[2] = high_now;
                        aux[3] = st == 1 ? 1 : 2; /* 2: a key stored and live, not placed: rebuild the table */
                        speculated = st == 1;
                    }
                }
            }
        }
        PyObject *pm = PyLong_FromSsize_t(m), *ps = PyFloat_FromDouble(saved_best);
        if (pm && ps)
            res = PyTuple_Pack(7, args[14], pm, order, ps, fetch ? Py_True : Py_False,
                               speculated ? Py_True : Py_False, arrays);
        Py_XDECREF(pm);
        Py_XDECREF(ps);
    }
done:
    Py_XDECREF(order);
    Py_XDECREF(arrays);
    for (int j = 0; j < got; j++)
        PyBuffer_Release(&b[j]);
    return res;
}

static PyMethodDef methods[] = {
    {"rows", (PyCFunction)(void (*)(void))route_rows, METH_FASTCALL, "A request's rows (see the module source)."},
    {"lead", (PyCFunction)(void (*)(void))route_lead, METH_FASTCALL, "Holdings over the byte table."},
    {"sparse", (PyCFunction)(void (*)(void))route_sparse, METH_FASTCALL, "The sparse walk over the byte table."},
    {"sparse_cols", (PyCFunction)(void (*)(void))route_sparse_cols, METH_FASTCALL,
     "The sparse walk over each worker's columns."},
    {"lead_cols", (PyCFunction)(void (*)(void))route_lead_cols, METH_FASTCALL, "Holdings over each worker's columns."},
    {"rank", (PyCFunction)(void (*)(void))route_rank, METH_FASTCALL, "Costs and the best top_k workers."},
    {"decide", (PyCFunction)(void (*)(void))route_decide, METH_FASTCALL, "rows, lead and rank at once."},
    {"digest64", (PyCFunction)route_digest64, METH_O, "blake2b-64 of bytes (at most 128), read little-endian."},
    {"insert", (PyCFunction)(void (*)(void))route_insert, METH_FASTCALL, "Give rows to new 16-byte keys."},
    {"place", (PyCFunction)(void (*)(void))route_place, METH_FASTCALL, "Place rows in the slots."},
    {"set_bit", (PyCFunction)(void (*)(void))route_set_bit, METH_FASTCALL, "Set a column in rows."},
    {"unset", (PyCFunction)(void (*)(void))route_unset, METH_FASTCALL, "Clear a column in the keys' rows."},
    {"fill", (PyCFunction)(void (*)(void))route_fill, METH_FASTCALL, "Rows for the keys not indexed yet."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_route",
                                    "The router's decision, compiled (client/routing/_route.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

/* The interface these functions offer (kvtier.client.routing.compiled.ROUTE_ABI): raised with
 * every change of their arguments, so a build left from older sources is not called. */
#define ROUTE_ABI 4

PyMODINIT_FUNC PyInit__route(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", ROUTE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
