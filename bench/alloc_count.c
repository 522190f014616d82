/* A counting malloc for the allocation rows of bench/portal_udp.py.
 *
 * tracemalloc sees only live memory, so it cannot say how much a round trip
 * allocates and frees again. Run Python with PYTHONMALLOC=malloc (every object
 * allocation goes to malloc) and LD_PRELOAD=this library: each malloc, calloc
 * and realloc adds one call and its size to the counters, which the process
 * reads with ctypes (mg_alloc_calls, mg_alloc_bytes). glibc's __libc_* entry
 * points do the work, so no dlsym is needed before the first allocation.
 *
 *   gcc -O2 -shared -fPIC -o alloc_count.so bench/alloc_count.c
 */
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

unsigned long long mg_alloc_calls;
unsigned long long mg_alloc_bytes;

static inline void count(size_t n) {
    __atomic_add_fetch(&mg_alloc_calls, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&mg_alloc_bytes, n, __ATOMIC_RELAXED);
}

void *malloc(size_t n) { count(n); return __libc_malloc(n); }
void *calloc(size_t k, size_t n) { count(k * n); return __libc_calloc(k, n); }
void *realloc(void *p, size_t n) { count(n); return __libc_realloc(p, n); }
