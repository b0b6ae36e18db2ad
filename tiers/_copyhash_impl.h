/* The copy loops of kvtier.tiers._copyhash (tiers/_copyhash.c), included by it (baseline
   x86-64: SSE2) and by tiers/_copyhash_avx2.c (compiled for AVX2, chosen at run time). */
#ifndef KVTIER_COPYHASH_IMPL_H
#define KVTIER_COPYHASH_IMPL_H
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

/* Copy n bytes from s to d; the xxh3-64 of the bytes copied (each chunk hashed, then copied
   from the cache). */
static uint64_t copy_hash_impl(char *d, const char *s, size_t n) {
    XXH64_hash_t h;
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
    return (uint64_t)h;
}
#endif
