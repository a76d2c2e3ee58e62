// The kernels' one thread pool: every parallel loop of the library runs on it.
//
// Why not OpenMP's: a parallel region ends at a barrier that waits for every thread of
// the team, and a thread the scheduler has taken off its core (another program wants it)
// holds everyone up for a time slice, however little work it had; a decode step crosses
// hundreds of such barriers, and OpenMP's threads spin while they wait, taking the cores
// the late thread needs. Here a job is a range of independent tasks, cut into one
// contiguous part per thread (so each thread streams its own weights in order, as a
// static schedule would); a thread works through its part a chunk at a time from the
// front, then takes chunks from the back of the parts that are left. The caller works
// too and waits only for chunks another thread has started: a thread that has not woken
// up has its whole part taken by the others and holds nothing up. Idle threads spin
// briefly (work comes back within microseconds inside a step) and then sleep on a
// condition variable, leaving the cores to others between steps.
//
// A task's result never depends on which thread ran it or how many there were: every
// task computes its own outputs from its own inputs, so the results are the same at any
// thread count (and, in the inline fallback, on the caller alone).

#include "common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 255
#define MAX_THREADS (MAX_WORKERS + 1)
#define SPIN_NS 50000          // how long an idle thread (or a waiting caller) spins
#define CHUNKS_PER_THREAD 8    // a part is worked through in about this many chunks
#define TASK_BITS 20
#define MAX_JOB_TASKS ((1 << TASK_BITS) - 1)  // per round: a part's bounds take 20 bits
#define GENERATION_MASK ((1u << 24) - 1)

// A part: (generation << 40) | (first << 20) | end, its tasks [first, end). A thread acts
// on a part only where its generation is the running job's.
typedef _Atomic uint64_t part_t;

static inline uint64_t pack(uint64_t generation, uint64_t first, uint64_t end) {
    return generation << (2 * TASK_BITS) | first << TASK_BITS | end;
}
static inline uint64_t generation_of(uint64_t part) { return part >> (2 * TASK_BITS); }
static inline int64_t first_of_part(uint64_t part) {
    return (int64_t)((part >> TASK_BITS) & MAX_JOB_TASKS);
}
static inline int64_t end_of_part(uint64_t part) { return (int64_t)(part & MAX_JOB_TASKS); }

// A job, published by the caller holding `pool.running`: its fields are written before
// its generation is, and read by a worker only while it holds a claimed chunk, which
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
    int started;              // workers created
    int sleepers;             // workers waiting on `wake` (under `lock`)
    bool caller_sleeps;       // the caller waits on `finished` (under `lock`)
    job_t job;
    // (generation << 32) | (tasks << 8) | (threads - 1): the running job, if its
    // generation is the parts' (a retired job has no tasks).
    _Atomic uint64_t limit;
    _Atomic uint32_t done;    // tasks finished in the current job
    _Atomic int64_t chunk;    // tasks a claim from one's own part takes
    part_t parts[MAX_THREADS];
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

// The running job as a worker may see it: its generation and thread count, or false.
static bool running_job(uint64_t *generation, int *threads) {
    const uint64_t limit = atomic_load_explicit(&pool.limit, memory_order_acquire);
    if (((limit & 0xffffffffu) >> 8) == 0) return false;
    *generation = (limit >> 32) & GENERATION_MASK;
    *threads = (int)(limit & 0xff) + 1;
    return true;
}

// Take up to `want` tasks from part p, and at most half of what it has left (rounded up):
// from its front (its owner) or its back (another thread). The first task taken, or -1
// where it has none (or belongs to another job). Halving the last claims leaves the
// threads a few tasks' difference at the job's end, not a chunk's (a prefill's chunk is
// milliseconds of products), when one was slowed or stole.
static int64_t take(int p, uint64_t generation, int64_t want, bool front, int64_t *count) {
    uint64_t part = atomic_load_explicit(&pool.parts[p], memory_order_acquire);
    for (;;) {
        const int64_t first = first_of_part(part), end = end_of_part(part);
        if (generation_of(part) != generation || first >= end) return -1;
        const int64_t half = (end - first + 1) / 2;
        const int64_t n = want < half ? want : half;
        const uint64_t rest = front ? pack(generation, (uint64_t)(first + n), (uint64_t)end)
                                    : pack(generation, (uint64_t)first, (uint64_t)(end - n));
        if (atomic_compare_exchange_weak_explicit(&pool.parts[p], &part, rest,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *count = n;
            return front ? first : end - n;
        }
    }
}

// The next chunk for thread `id`: from its own part, else from another's back.
static int64_t claim(int id, int64_t *count) {
    uint64_t generation;
    int threads;
    if (!running_job(&generation, &threads) || id >= threads) return -1;
    const int64_t chunk = atomic_load_explicit(&pool.chunk, memory_order_relaxed);
    int64_t first = take(id, generation, chunk, true, count);
    for (int k = 1; first < 0 && k < threads; k++)
        first = take((id + k) % threads, generation, chunk, false, count);
    return first;
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

// Whether some part of the running job has tasks that thread `id` may take.
static bool has_work(int id) {
    uint64_t generation;
    int threads;
    if (!running_job(&generation, &threads) || id >= threads) return false;
    for (int p = 0; p < threads; p++) {
        const uint64_t part = atomic_load_explicit(&pool.parts[p], memory_order_acquire);
        if (generation_of(part) == generation && first_of_part(part) < end_of_part(part))
            return true;
    }
    return false;
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

// One round: tasks 0 .. tasks - 1 of the job (offset by base), on `threads` threads.
static void run_round(spnl_task fn, void *ctx, int64_t base, int64_t tasks, int threads) {
    pool.job = (job_t){fn, ctx, base};
    const int64_t chunk = tasks / ((int64_t)threads * CHUNKS_PER_THREAD);
    atomic_store_explicit(&pool.chunk, chunk > 1 ? chunk : 1, memory_order_relaxed);
    const uint64_t generation = ++pool.generation & GENERATION_MASK;
    for (int p = 0; p < threads; p++) {  // thread p's part: its share, in order
        const uint64_t first = (uint64_t)(tasks * p / threads);
        const uint64_t end = (uint64_t)(tasks * (p + 1) / threads);
        atomic_store_explicit(&pool.parts[p], pack(generation, first, end), memory_order_relaxed);
    }
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.limit,
                          generation << 32 | (uint64_t)tasks << 8 | (uint64_t)(threads - 1),
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
    atomic_store_explicit(&pool.limit, generation << 32, memory_order_release);  // retired
}

void spnl_parallel(int64_t tasks, spnl_task fn, void *ctx, int threads) {
    if (tasks <= 0) return;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
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
        const int used = threads < round ? threads : (int)round;
        if (used == 1) {
            for (int64_t t = 0; t < round; t++) fn(ctx, base + t, 0);
        } else {
            run_round(fn, ctx, base, round, used);
        }
    }
    pthread_mutex_unlock(&pool.running);
}

// For the tests: `rounds` jobs of `tasks` tasks each, every task adding 1 to its counter
// (counts [tasks], int64): each must end at `rounds`, none lost, none run twice.
static void count_task(void *ctx, int64_t task, int worker) {
    (void)worker;
    atomic_fetch_add_explicit((_Atomic int64_t *)ctx + task, 1, memory_order_relaxed);
}

int spnl_pool_check(int64_t tasks, int threads, int rounds, int64_t *counts) {
    if (tasks < 0 || rounds < 0) return BAD_ARGUMENT;
    for (int r = 0; r < rounds; r++) spnl_parallel(tasks, count_task, counts, threads);
    return 0;
}
