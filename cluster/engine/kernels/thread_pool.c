/*
 * One pool of worker threads per process for the native kernels: pool_run(count, fn, ctx, threads)
 * runs fn(ctx, task, slot) for task in 0..count-1 on up to `threads` threads (the caller is one of
 * them, slot 0), handing tasks out one at a time, and returns when all have run.
 *
 * Why not OpenMP: libgomp keeps a team of threads per thread that opens a parallel region, and
 * once the teams of a process together hold more threads than there are CPUs it stops spinning
 * between regions and puts its workers to sleep after ~100 spins. A worker process steps its
 * engine on one thread, but its start-up profile, calls and KV receives run torch ops on others,
 * so it crossed that line: each of a decode step's ~180 regions then woke a sleeping thread, and
 * a SmolLM2-135M step took 9-12 ms in the cluster against 5.5 ms alone (2 cores). This pool is
 * one per process whatever thread calls it, its workers spin ~SPIN_NS between runs (a step's
 * regions follow each other within microseconds) before they sleep, and a thread that has done its
 * share takes what is left of the others', so a worker the OS preempts delays only the task it
 * holds.
 *
 * One run at a time: a call made while another thread's run is in progress runs its tasks on the
 * calling thread alone.
 */
#ifndef TANDEM_THREAD_POOL
#define TANDEM_THREAD_POOL
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define POOL_MAX_WORKERS 255
#define SPIN_NS 200000 /* a worker's wait before it sleeps: longer than a step's gaps, shorter than the Python between steps */

typedef void (*pool_task)(void *ctx, int64_t task, int slot);

static struct {
    pthread_mutex_t run;   /* held by the thread whose run is in progress */
    pthread_mutex_t sleep; /* with `wake`: workers that stopped spinning wait here */
    pthread_cond_t wake;
    int workers;          /* started */
    int sleeping;         /* under `sleep` */
    atomic_uint generation; /* bumped to start a run */
    atomic_int pending;     /* workers yet to finish the run */
    pool_task fn;
    void *ctx;
    int active; /* threads that take tasks in this run, the caller included */
} pool = {.run = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The run's tasks cut into one contiguous range per thread: a thread takes the tasks of its own
 * range in order (a kernel reads its share of a weight front to back), then helps with the others'. */
typedef struct {
    _Alignas(64) atomic_llong next;
    int64_t end;
} task_range;

static task_range ranges[POOL_MAX_WORKERS + 1];

static void take_tasks(int slot) {
    const int active = pool.active;
    for (int i = 0; i < active; ++i) {
        task_range *range = &ranges[(slot + i) % active];
        for (;;) {
            const int64_t task = atomic_fetch_add_explicit(&range->next, 1, memory_order_relaxed);
            if (task >= range->end) break;
            pool.fn(pool.ctx, task, slot);
        }
    }
}

/* Waits until `generation` differs from `seen`: spinning first, then asleep. */
static unsigned wait_for_run(unsigned seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; ++spins) {
        const unsigned generation = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (generation != seen) return generation;
        CPU_RELAX();
        if ((spins & 255) == 255 && now_ns() > until) break;
    }
    pthread_mutex_lock(&pool.sleep);
    ++pool.sleeping;
    unsigned generation;
    while ((generation = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen)
        pthread_cond_wait(&pool.wake, &pool.sleep);
    --pool.sleeping;
    pthread_mutex_unlock(&pool.sleep);
    return generation;
}

typedef struct {
    int slot;
    unsigned generation; /* when it was started, read by its creator: a run may start before the new thread first looks */
} worker_start;

static void *worker_main(void *arg) {
    const worker_start start = *(worker_start *)arg;
    free(arg);
    const int slot = start.slot;
    unsigned seen = start.generation;
    for (;;) {
        seen = wait_for_run(seen);
        /* Every worker answers every run (the caller waits for all), so none can still be in
         * this run when the next one changes the fields below. */
        if (slot < pool.active) take_tasks(slot);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* A child forked from a process with workers has none of them: it starts its own. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.run, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.sleeping = 0;
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* Starts workers until there are `wanted` (under `run`); returns how many there are. */
static int grow(int wanted) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, watch_forks);
    if (wanted > POOL_MAX_WORKERS) wanted = POOL_MAX_WORKERS;
    while (pool.workers < wanted) {
        worker_start *start = malloc(sizeof *start);
        if (!start) break;
        start->slot = pool.workers + 1;
        start->generation = atomic_load_explicit(&pool.generation, memory_order_relaxed);
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker_main, start);
        pthread_attr_destroy(&attr);
        if (failed) {
            free(start);
            break;
        }
        ++pool.workers;
    }
    return pool.workers;
}

static void pool_run(int64_t count, pool_task fn, void *ctx, int threads) {
    if (threads <= 1 || count <= 1 || pthread_mutex_trylock(&pool.run) != 0) {
        for (int64_t task = 0; task < count; ++task) fn(ctx, task, 0);
        return;
    }
    const int workers = grow(threads - 1);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.active = threads < workers + 1 ? threads : workers + 1;
    for (int r = 0; r < pool.active; ++r) {
        atomic_store_explicit(&ranges[r].next, count * r / pool.active, memory_order_relaxed);
        ranges[r].end = count * (r + 1) / pool.active;
    }
    atomic_store_explicit(&pool.pending, workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_mutex_lock(&pool.sleep);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    take_tasks(0);
    for (int spins = 0; atomic_load_explicit(&pool.pending, memory_order_acquire); ++spins) {
        CPU_RELAX();
        if ((spins & 1023) == 1023) sched_yield(); /* a worker holding a task may be waiting for this CPU */
    }
    pthread_mutex_unlock(&pool.run);
}

/* The number of tasks of at most `per_task` items each that cover `items`, for pool_run. */
static inline int64_t task_count(int64_t items, int64_t per_task) { return (items + per_task - 1) / per_task; }
#endif
