// The machine's read bound for decode, for the benches (bench/read_bound.py measures it):
// bytes read by the fastest plain loop we can write (64-byte vector loads summed into
// independent accumulators, software prefetch a few KiB ahead), on 1 or more threads. Not
// part of the library: built by the bench with the system's compiler.
//
// Two ways to share the bytes among the threads: "whole", each thread one contiguous
// slice of all the tensors together (no synchronisation inside a token: the best case),
// and "each", every tensor split among the threads with a barrier after it (what one
// parallel product per matrix costs, the pool's dispatches aside).

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PREFETCH 4096

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static uint64_t read_span(const uint8_t *p, int64_t bytes) {
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= bytes; i += 256) {
        __builtin_prefetch(p + i + PREFETCH, 0, 3);
        __builtin_prefetch(p + i + PREFETCH + 64, 0, 3);
        __builtin_prefetch(p + i + PREFETCH + 128, 0, 3);
        __builtin_prefetch(p + i + PREFETCH + 192, 0, 3);
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t out[8];
    _mm512_storeu_si512((void *)out, a0);
    uint64_t s = out[0] ^ out[1] ^ out[2] ^ out[3] ^ out[4] ^ out[5] ^ out[6] ^ out[7];
#else
    uint64_t s = 0;
    int64_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
#endif
    for (; i < bytes; i++) s ^= p[i];
    return s;
}

typedef struct {
    const uint8_t *const *ptrs;
    const int64_t *sizes;
    int count, threads, id, mode;
    _Atomic int *arrived;
    _Atomic int *go;  // 0: wait, 1: read, -1: a thread could not be started, read nothing
    uint64_t result;
} job;

// The part [first, end) of n bytes that thread id of t reads, cut at 256-byte multiples.
static void share(int64_t n, int id, int t, int64_t *first, int64_t *end) {
    const int64_t units = n / 256;
    *first = units * id / t * 256;
    *end = id == t - 1 ? n : units * (id + 1) / t * 256;
}

static void barrier(_Atomic int *arrived, int threads, int round) {
    atomic_fetch_add_explicit(arrived, 1, memory_order_acq_rel);
    while (atomic_load_explicit(arrived, memory_order_acquire) < threads * (round + 1))
        RELAX();
}

static void *run(void *arg) {
    job *j = arg;
    uint64_t s = 0;
    int go;
    while ((go = atomic_load_explicit(j->go, memory_order_acquire)) == 0) RELAX();
    if (go < 0) return NULL;
    if (j->mode == 0) {  // whole: one slice of the concatenation
        int64_t total = 0;
        for (int k = 0; k < j->count; k++) total += j->sizes[k];
        int64_t first, end;
        share(total, j->id, j->threads, &first, &end);
        int64_t at = 0;
        for (int k = 0; k < j->count && at < end; k++) {
            const int64_t lo = first > at ? first - at : 0;
            const int64_t hi = end - at < j->sizes[k] ? end - at : j->sizes[k];
            if (hi > lo) s ^= read_span(j->ptrs[k] + lo, hi - lo);
            at += j->sizes[k];
        }
    } else {  // each: every tensor shared, a barrier after each
        for (int k = 0; k < j->count; k++) {
            int64_t first, end;
            share(j->sizes[k], j->id, j->threads, &first, &end);
            s ^= read_span(j->ptrs[k] + first, end - first);
            if (j->threads > 1) barrier(j->arrived, j->threads, k);
        }
    }
    j->result = s;
    return NULL;
}

// Read every tensor once on `threads` threads (mode 0: whole, 1: each), all of them
// started before any reads; `*checksum` is a value that depends on every byte read (so the
// loads are kept). Returns 0, or pthread_create's error where a thread could not be
// started (then nothing is read: fewer threads would measure something else).
int spnl_bench_read(const uint8_t *const *ptrs, const int64_t *sizes, int count, int threads,
                    int mode, uint64_t *checksum) {
    if (threads < 1) return EINVAL;
    job jobs[threads];
    pthread_t ids[threads];
    _Atomic int arrived = 0, go = 0;
    int error = 0, started = 1;
    for (int t = 0; t < threads; t++)
        jobs[t] = (job){ptrs, sizes, count, threads, t, mode, &arrived, &go, 0};
    for (; started < threads && !error; started++)
        error = pthread_create(&ids[started], NULL, run, &jobs[started]);
    if (error) started--;  // the last one tried is not running
    atomic_store_explicit(&go, error ? -1 : 1, memory_order_release);
    if (!error) run(&jobs[0]);
    uint64_t s = jobs[0].result;
    for (int t = 1; t < started; t++) {
        pthread_join(ids[t], NULL);
        s ^= jobs[t].result;
    }
    *checksum = s;
    return error;
}
