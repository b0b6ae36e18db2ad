/* copy_hash of kvtier.tiers._copyhash (tiers/_copyhash.c) compiled for AVX2: xxh3's AVX2
   loop and the same non-temporal copy; called only when the CPU has AVX2. Other compilers and
   CPUs: an empty unit (the baseline loop serves). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx2")
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include "_copyhash_impl.h"

uint64_t kvtier_copy_hash_avx2(char *d, const char *s, size_t n);

uint64_t kvtier_copy_hash_avx2(char *d, const char *s, size_t n) { return copy_hash_impl(d, s, n); }
#else
typedef int kvtier_copyhash_avx2_unused;
#endif
