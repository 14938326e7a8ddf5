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
 * holds. A run waits only for the workers that joined it: once the caller has taken the last task
 * the run is closed, and a worker that wakes later (still asleep, or woken onto the caller's own
 * CPU, as Linux did after the engine idled ~200 ms) skips it instead of holding the caller until
 * it gets a CPU.
 *
 * On Linux the workers keep off the CPU the calling thread runs on (their affinity, set again only
 * when the caller is found on another CPU). A guest kernel wakes a sleeping thread on the waker's
 * own CPU when the other vCPUs are halted (it reads them as preempted): after the engine idled
 * ~200 ms, every run of a step then woke its worker onto the caller's CPU, where it spun while the
 * caller waited, and on the 2-core VM a seen 20-token prompt's first token took 18-20 ms (p50;
 * 30-45 ms p90) against 7 ms.
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
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define POOL_MAX_WORKERS 255
#define RUN_OPEN (1ull << 31)
#define RUN_JOINED (RUN_OPEN - 1)
#define SPIN_NS 200000 /* a worker's wait before it sleeps: longer than a step's gaps, shorter than the Python between steps */

typedef void (*pool_task)(void *ctx, int64_t task, int slot);

static struct {
    pthread_mutex_t run;   /* held by the thread whose run is in progress */
    pthread_mutex_t sleep; /* with `wake`: workers that stopped spinning wait here */
    pthread_cond_t wake;
    int workers;          /* started */
    pthread_t threads[POOL_MAX_WORKERS];
    int caller_cpu;       /* the CPU the workers were last kept off; -1: none yet */
    int sleeping;         /* under `sleep` */
    /* The run's generation (high 32 bits), RUN_OPEN while workers may join it, and how many
     * workers are in it (the bits below): one word, so that a worker joins only an open run. */
    _Alignas(64) atomic_ullong state;
    pool_task fn;
    void *ctx;
    int active; /* threads that take tasks in this run, the caller included */
} pool = {.run = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
          .caller_cpu = -1};

/* Each worker's kernel thread id, once it has started (0 before): pool_worker_tids. */
static atomic_int worker_tids[POOL_MAX_WORKERS];

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

static unsigned generation_of(uint64_t state) { return (unsigned)(state >> 32); }

/* Waits until the run's generation differs from `seen`: spinning first, then asleep. */
static unsigned wait_for_run(unsigned seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; ++spins) {
        const unsigned generation = generation_of(atomic_load_explicit(&pool.state, memory_order_acquire));
        if (generation != seen) return generation;
        CPU_RELAX();
        if ((spins & 255) == 255 && now_ns() > until) break;
    }
    pthread_mutex_lock(&pool.sleep);
    ++pool.sleeping;
    unsigned generation;
    while ((generation = generation_of(atomic_load_explicit(&pool.state, memory_order_acquire))) == seen)
        pthread_cond_wait(&pool.wake, &pool.sleep);
    --pool.sleeping;
    pthread_mutex_unlock(&pool.sleep);
    return generation;
}

/* Joins run `generation` if it is still open; 1 when joined (the caller then waits for it). */
static int join_run(unsigned generation) {
    uint64_t state = atomic_load_explicit(&pool.state, memory_order_acquire);
    while (generation_of(state) == generation && (state & RUN_OPEN))
        if (atomic_compare_exchange_weak_explicit(&pool.state, &state, state + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    return 0;
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
#ifdef __linux__
    atomic_store_explicit(&worker_tids[slot - 1], (int)syscall(SYS_gettid), memory_order_release);
#endif
    for (;;) {
        seen = wait_for_run(seen);
        /* The caller waits for every worker that joined, so none is still in this run when the
         * next one changes the fields below; one that comes after the run closed skips it. */
        if (!join_run(seen)) continue;
        if (slot < pool.active) take_tasks(slot);
        atomic_fetch_sub_explicit(&pool.state, 1, memory_order_release);
    }
    return NULL;
}

/* A child forked from a process with workers has none of them: it starts its own. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.run, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.sleeping = 0;
    for (int w = 0; w < POOL_MAX_WORKERS; ++w) atomic_store_explicit(&worker_tids[w], 0, memory_order_relaxed);
    pool.caller_cpu = -1;
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
        start->generation = generation_of(atomic_load_explicit(&pool.state, memory_order_relaxed));
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
        pool.threads[pool.workers++] = thread;
        pool.caller_cpu = -1; /* the new worker may run anywhere: placed with the others on this run */
    }
    return pool.workers;
}

/* Keeps the workers off the CPU the caller runs on (under `run`), where the caller's own CPUs
 * leave them another; set again only when the caller has moved. */
static void keep_workers_off_caller(void) {
#ifdef __linux__
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == pool.caller_cpu) return;
    pool.caller_cpu = cpu;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || cpu >= CPU_SETSIZE) return;
    CPU_CLR(cpu, &allowed);
    if (CPU_COUNT(&allowed) == 0) return; /* a caller with one CPU: the workers stay where they may */
    for (int w = 0; w < pool.workers; ++w) pthread_setaffinity_np(pool.threads[w], sizeof allowed, &allowed);
#endif
}

static void pool_run(int64_t count, pool_task fn, void *ctx, int threads) {
    if (threads <= 1 || count <= 1 || pthread_mutex_trylock(&pool.run) != 0) {
        for (int64_t task = 0; task < count; ++task) fn(ctx, task, 0);
        return;
    }
    const int workers = grow(threads - 1);
    keep_workers_off_caller();
    pool.fn = fn;
    pool.ctx = ctx;
    pool.active = threads < workers + 1 ? threads : workers + 1;
    for (int r = 0; r < pool.active; ++r) {
        atomic_store_explicit(&ranges[r].next, count * r / pool.active, memory_order_relaxed);
        ranges[r].end = count * (r + 1) / pool.active;
    }
    const unsigned generation = generation_of(atomic_load_explicit(&pool.state, memory_order_relaxed)) + 1;
    atomic_store_explicit(&pool.state, ((uint64_t)generation << 32) | RUN_OPEN, memory_order_release);
    pthread_mutex_lock(&pool.sleep);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    take_tasks(0); /* returns once every task is taken: no worker that joins from now on has one */
    uint64_t state = atomic_fetch_and_explicit(&pool.state, ~RUN_OPEN, memory_order_acq_rel);
    for (int spins = 0; state & RUN_JOINED; ++spins) {
        CPU_RELAX();
        if ((spins & 1023) == 1023) sched_yield(); /* a worker holding a task may be waiting for this CPU */
        state = atomic_load_explicit(&pool.state, memory_order_acquire);
    }
    pthread_mutex_unlock(&pool.run);
}

/* The kernel thread ids of the workers started so far (at most `max`, into `out`); how many. A
 * worker just started may not have written its id yet: it is left out. Linux only (0 elsewhere). */
int pool_worker_tids(int *out, int max) {
    int found = 0;
    for (int w = 0; w < pool.workers && found < max; ++w) {
        const int tid = atomic_load_explicit(&worker_tids[w], memory_order_acquire);
        if (tid > 0) out[found++] = tid;
    }
    return found;
}

/* The number of tasks of at most `per_task` items each that cover `items`, for pool_run. */
static inline int64_t task_count(int64_t items, int64_t per_task) { return (items + per_task - 1) / per_task; }
#endif
