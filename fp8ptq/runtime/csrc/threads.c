/* The threads of every kernel, and the small entry points that belong to no kernel family. */

#include "common.h"

void fork_join(void *(*fn)(void *), void *parts, size_t size, int t) {
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    char *base = (char *)parts;
    for (int k = 1; k < t; k++)
        started[k] = pthread_create(&tids[k], NULL, fn, base + (size_t)k * size) == 0;
    fn(base);
    for (int k = 1; k < t; k++) {
        if (started[k]) pthread_join(tids[k], NULL);
        else fn(base + (size_t)k * size);
    }
}

int thread_count(int64_t n, int nthreads) {
    int64_t t = n / MIN_PER_THREAD;
    if (t > nthreads) t = nthreads;
    if (t > MAX_THREADS) t = MAX_THREADS;
    return t < 1 ? 1 : (int)t;
}

int row_split(int64_t rows, int64_t cols, int nthreads, int64_t *at) {
    int t = thread_count(rows * cols, nthreads);
    if (t > rows) t = rows < 1 ? 1 : (int)rows;
    int64_t per = (rows + t - 1) / t;
    for (int k = 0; k <= t; k++) at[k] = k * per < rows ? k * per : rows;
    return t;
}

int fp8ptq_have_f16(void) { return HAVE_F16; }

/* Ask for transparent huge pages on the 2 MiB-aligned interior of a fresh output buffer: the
 * kernels write it once, and first-touch faults on 4 KiB pages cost more than the kernel
 * itself on a 64 MB output (the THP setting "madvise" is the common default). */
void fp8ptq_advise_huge(void *p, int64_t n) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t e = ((uintptr_t)p + (uintptr_t)n) & ~(huge - 1);
    if (e > a) madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}
