// The kernels' one thread pool: every parallel loop of the library runs on it.
//
// Why not OpenMP's: a parallel region ends at a barrier that waits for every thread of
// the team, and a thread the scheduler has taken off its core (another program wants it)
// holds everyone up for a time slice, however little work it had; a decode step crosses
// hundreds of such barriers, so with other work on the cores two threads ran 18x slower
// than one. Here a job is a range of independent tasks that the threads claim a chunk at
// a time: the caller works too, and waits only for chunks that some thread has started;
// a thread that has not woken up yet holds nothing up. Idle threads spin briefly (work
// comes back within microseconds inside a step) and then sleep on a condition variable,
// so between steps they leave the cores to others.
//
// A task's result never depends on which thread ran it or how many there were: every
// task computes its own outputs from its own inputs, so the results are the same at any
// thread count (and, in the inline fallback, on the caller alone).

#include "common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 255
#define SPIN_NS 50000          // how long an idle thread (or a waiting caller) spins
#define CHUNKS_PER_THREAD 8    // a job's tasks are claimed in about this many chunks each
#define MAX_JOB_TASKS ((1 << 24) - 1)  // tasks << 8 fits the limit word's low 32 bits

// A job, published by the caller holding `pool.running`: fields are written before the
// cursor's generation is, and read by a worker only while it holds a claimed chunk, which
// keeps the caller (hence the job) where it is.
typedef struct {
    spnl_task fn;
    void *ctx;
    int64_t base;  // the first task of this round (jobs of more tasks run in rounds)
} job_t;

static struct {
    pthread_mutex_t running;  // one job at a time; a second caller runs its tasks inline
    pthread_mutex_t lock;     // guards the two condition variables' waits
    pthread_cond_t wake, finished;
    int started;                  // workers created
    int sleepers;                 // workers waiting on `wake` (under `lock`)
    bool caller_sleeps;           // the caller waits on `finished` (under `lock`)
    job_t job;
    // (generation << 32) | next task, and (generation << 32) | tasks << 8 | threads: a
    // worker claims tasks only where both carry the same generation.
    _Atomic uint64_t cursor, limit;
    _Atomic uint32_t done;    // tasks finished in the current job
    _Atomic int64_t chunk;    // tasks a claim takes (read before a claim: any value works)
    uint32_t generation;
} pool = {
    .running = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// Claim the next chunk of the current job for worker `id`: its first task, or -1 where
// there is none (no job, another generation's, done, or one this worker may not join).
static int64_t claim(int id, int64_t *count) {
    for (;;) {
        const uint64_t limit = atomic_load_explicit(&pool.limit, memory_order_acquire);
        uint64_t cursor = atomic_load_explicit(&pool.cursor, memory_order_acquire);
        const int64_t tasks = (int64_t)((limit & 0xffffffffu) >> 8);
        const int threads = (int)(limit & 0xff) + 1;
        if ((cursor >> 32) != (limit >> 32) || id >= threads) return -1;
        const int64_t next = (int64_t)(cursor & 0xffffffffu);
        if (next >= tasks) return -1;
        int64_t chunk = atomic_load_explicit(&pool.chunk, memory_order_relaxed);
        chunk = chunk < 1 ? 1 : chunk < tasks - next ? chunk : tasks - next;
        const uint64_t claimed = (cursor & ~(uint64_t)0xffffffffu) | (uint64_t)(next + chunk);
        if (atomic_compare_exchange_weak_explicit(&pool.cursor, &cursor, claimed,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *count = chunk;
            return next;
        }
    }
}

// Run claimed chunks until none is left; the caller is woken by the last task's end.
static void work(int id) {
    int64_t count;
    for (int64_t first; (first = claim(id, &count)) >= 0;) {
        const job_t job = pool.job;  // stable while this chunk is claimed and unfinished
        const uint64_t limit = atomic_load_explicit(&pool.limit, memory_order_relaxed);
        const uint32_t tasks = (uint32_t)((limit & 0xffffffffu) >> 8);
        for (int64_t t = first; t < first + count; t++) job.fn(job.ctx, job.base + t, id);
        const uint32_t done =
            atomic_fetch_add_explicit(&pool.done, (uint32_t)count, memory_order_acq_rel) +
            (uint32_t)count;
        if (done == tasks) {
            pthread_mutex_lock(&pool.lock);
            if (pool.caller_sleeps) pthread_cond_signal(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static bool has_work(int id) {
    const uint64_t limit = atomic_load_explicit(&pool.limit, memory_order_acquire);
    const uint64_t cursor = atomic_load_explicit(&pool.cursor, memory_order_acquire);
    return (cursor >> 32) == (limit >> 32) && id < (int)(limit & 0xff) + 1
           && (int64_t)(cursor & 0xffffffffu) < (int64_t)((limit & 0xffffffffu) >> 8);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    for (;;) {
        work(id);
        const int64_t until = now_ns() + SPIN_NS;
        bool found = false;
        for (int i = 0; !found; i++) {
            found = has_work(id);
            relax();
            if ((i & 63) == 63 && now_ns() > until) break;
        }
        if (found) continue;
        pthread_mutex_lock(&pool.lock);
        pool.sleepers++;
        while (!has_work(id)) pthread_cond_wait(&pool.wake, &pool.lock);
        pool.sleepers--;
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

// Workers 1 .. wanted - 1 exist: the threads a job of `wanted` may use (fewer where a thread
// could not be created; never more, though more workers may exist).
static int ensure_workers(int wanted) {
    while (pool.started < wanted - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed =
            pthread_create(&thread, &attr, worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    return pool.started + 1 < wanted ? pool.started + 1 : wanted;
}

// After fork() the child has none of the parent's threads: it starts its own pool.
static void forked_child(void) {
    pthread_mutex_init(&pool.running, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.started = pool.sleepers = 0;
    pool.caller_sleeps = false;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, forked_child); }

// One round: tasks 0 .. tasks - 1 of the job (offset by base), on up to `threads` threads.
static void run_round(spnl_task fn, void *ctx, int64_t base, int64_t tasks, int threads) {
    pool.job = (job_t){fn, ctx, base};
    const int64_t chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    atomic_store_explicit(&pool.chunk, tasks / chunks > 1 ? tasks / chunks : 1,
                          memory_order_relaxed);
    const uint64_t generation = (uint64_t)++pool.generation << 32;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.cursor, generation, memory_order_release);
    atomic_store_explicit(&pool.limit, generation | (uint64_t)tasks << 8 | (uint64_t)(threads - 1),
                          memory_order_release);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    work(0);
    // Wait for the chunks other threads started: spin, then sleep until the last one ends.
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < (uint32_t)tasks;
         i++) {
        relax();
        if ((i & 63) != 63 || now_ns() < until) continue;
        pthread_mutex_lock(&pool.lock);
        pool.caller_sleeps = true;
        while (atomic_load_explicit(&pool.done, memory_order_acquire) < (uint32_t)tasks)
            pthread_cond_wait(&pool.finished, &pool.lock);
        pool.caller_sleeps = false;
        pthread_mutex_unlock(&pool.lock);
    }
    // Retire the job: no worker claims from it again.
    atomic_store_explicit(&pool.limit, generation, memory_order_release);
}

void spnl_parallel(int64_t tasks, spnl_task fn, void *ctx, int threads) {
    if (tasks <= 0) return;
    threads = threads < 1 ? 1 : threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads;
    if (threads > tasks) threads = (int)tasks;
    if (threads == 1 || pthread_mutex_trylock(&pool.running) != 0) {
        // One thread, or another caller's job is running: this one runs inline.
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t, 0);
        return;
    }
    pthread_once(&once, register_fork);
    threads = ensure_workers(threads);
    for (int64_t base = 0; base < tasks; base += MAX_JOB_TASKS) {
        const int64_t round = tasks - base < MAX_JOB_TASKS ? tasks - base : MAX_JOB_TASKS;
        if (threads == 1) {
            for (int64_t t = 0; t < round; t++) fn(ctx, base + t, 0);
        } else {
            run_round(fn, ctx, base, round, threads);
        }
    }
    pthread_mutex_unlock(&pool.running);
}

int spnl_pool_workers(void) { return pool.started; }
