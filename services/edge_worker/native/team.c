// The ops' own team of helper threads for their parallel sections, with a bounded spin (docs/edge.md, issue 27).
//
// Why: onnxruntime's intra-op threads either sleep as soon as a parallel section ends (allow_spinning=0: each of a
// decode step's ~150 sections then wakes a sleeping thread, which on this 2-core VM arrives late, so the caller
// does most chunks alone) or spin for a long while (allow_spinning=1: fast alone, but the spinning threads take
// the cores the gateway and the worker's own Python need). The team's helpers spin for at most `spin_us` after
// their last chunk, which spans the short gaps between one step's sections, then sleep on a futex; a step's
// sections so start at once while nothing spins between steps.
//
// Chunks are claimed one at a time with a compare-and-swap on (job generation, next chunk): a helper that was
// preempted or arrives late claims nothing of a job that is over, and the caller never waits for a helper that
// holds no chunk (it runs every unclaimed chunk itself). Which thread runs a chunk does not change its result (the
// ops compute every output element whole in one chunk), so the output is bit-identical to a serial run.
//
// One caller at a time uses the team (a second, concurrent one, e.g. another session in the same process, runs its
// chunks serially). `meshserve_team_spin_us(0)` (the default) leaves the ops on onnxruntime's own ParallelFor.
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ortapi.h"

#define MAX_HELPERS 31
#define CLOSED 0xFFFFFFFFu  // the chunk half of a ticket once its job is over: nothing left to claim

typedef void (*ChunkFn)(void* data, size_t index);

static struct {
    pthread_mutex_t caller;          // held by the thread whose job the team runs
    pthread_mutex_t grow;            // starting helpers
    int helpers;                     // started (they live as long as the process)
    _Atomic uint32_t wake;           // futex word: bumped for every job
    _Atomic uint64_t ticket;         // generation << 32 | next chunk (CLOSED when the job is over)
    _Atomic int running;             // helpers claiming or running a chunk: the caller waits for them
    _Atomic int sleepers;            // helpers asleep on `wake`
    _Atomic int64_t spin_ns;         // how long an idle helper spins before it sleeps; 0: the team is off
    _Atomic(ChunkFn) fn;             // the current job (written before its ticket is published, and only
    _Atomic(void*) data;             // after the job before it is closed and has no chunk running)
    _Atomic uint32_t n;
    uint32_t generation;
} team = {.caller = PTHREAD_MUTEX_INITIALIZER, .grow = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// A helper's share of the current job: claims chunks until none is left or the job is over. A claim succeeds only
// while the ticket still holds the job's generation and the claimed index, so the fields read before it belong to
// that job (the next job's fields are written only after this one is closed).
static void help(void) {
    uint64_t t = atomic_load(&team.ticket);
    for (;;) {
        uint32_t i = (uint32_t)t;
        ChunkFn fn = atomic_load_explicit(&team.fn, memory_order_relaxed);
        void* data = atomic_load_explicit(&team.data, memory_order_relaxed);
        if (i == CLOSED || i >= atomic_load_explicit(&team.n, memory_order_relaxed)) return;
        atomic_fetch_add(&team.running, 1);  // before the claim: a caller closing the job then waits for us
        if (atomic_compare_exchange_strong(&team.ticket, &t, t + 1)) {
            fn(data, i);
            t = atomic_load(&team.ticket);
        }  // else t holds the ticket as it is now
        atomic_fetch_sub(&team.running, 1);
    }
}

static void* helper_main(void* unused) {
    (void)unused;
    uint32_t seen = atomic_load(&team.wake);
    for (;;) {
        int64_t began = now_ns();
        unsigned spins = 0;
        while (atomic_load_explicit(&team.wake, memory_order_acquire) == seen) {
            _mm_pause();
            if ((++spins & 63) == 0 && now_ns() - began > atomic_load_explicit(&team.spin_ns, memory_order_relaxed)) {
                atomic_fetch_add(&team.sleepers, 1);
                syscall(SYS_futex, &team.wake, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&team.sleepers, 1);
                began = now_ns();
            }
        }
        seen = atomic_load(&team.wake);
        help();
    }
    return NULL;
}

// A child forked by a process with helpers has none (only the forking thread is copied): it starts its own.
static void forked_child(void) {
    pthread_mutex_init(&team.caller, NULL);
    pthread_mutex_init(&team.grow, NULL);
    team.helpers = 0;
    atomic_store(&team.running, 0);
    atomic_store(&team.sleepers, 0);
}

static pthread_once_t at_fork = PTHREAD_ONCE_INIT;
static void register_at_fork(void) { pthread_atfork(NULL, NULL, forked_child); }

static int grow(int helpers) {
    if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
    pthread_once(&at_fork, register_at_fork);
    pthread_mutex_lock(&team.grow);
    while (team.helpers < helpers) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        team.helpers++;
    }
    int have = team.helpers;
    pthread_mutex_unlock(&team.grow);
    return have;
}

// Sets how long idle helpers spin (microseconds); 0 turns the team off (the ops use onnxruntime's threads).
void meshserve_team_spin_us(int spin_us) {
    atomic_store(&team.spin_ns, spin_us > 0 ? (int64_t)spin_us * 1000 : 0);
    atomic_fetch_add(&team.wake, 1);  // helpers asleep re-read it (and find no job)
    syscall(SYS_futex, &team.wake, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
}

// Started helper threads (tests).
int meshserve_team_helpers(void) { return team.helpers; }

// Declared in ortapi.h. threads 0 (attention, which has no threads attribute): every helper started so far.
OrtStatus* parallel_for(const OrtApi* api, OrtKernelContext* context, ChunkFn fn, size_t n, void* data,
                        int64_t threads) {
    int off = atomic_load_explicit(&team.spin_ns, memory_order_relaxed) == 0 || n >= CLOSED;
    if (off || threads == 1 || (threads == 0 && team.helpers == 0))
        return api->KernelContext_ParallelFor(context, fn, n, 0, data);
    if (n == 1 || (threads > 1 && grow((int)threads - 1) == 0) || pthread_mutex_trylock(&team.caller) != 0) {
        for (size_t i = 0; i < n; i++) fn(data, i);
        return NULL;
    }
    uint32_t g = ++team.generation;
    atomic_store_explicit(&team.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&team.data, data, memory_order_relaxed);
    atomic_store_explicit(&team.n, (uint32_t)n, memory_order_relaxed);
    atomic_store(&team.ticket, (uint64_t)g << 32);  // publishes the fields above
    atomic_fetch_add(&team.wake, 1);
    if (atomic_load(&team.sleepers) > 0) syscall(SYS_futex, &team.wake, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
    for (uint64_t t = atomic_load(&team.ticket); (uint32_t)t < n;) {  // the caller claims like a helper
        if (atomic_compare_exchange_weak(&team.ticket, &t, t + 1)) {
            fn(data, (uint32_t)t);
            t = atomic_load(&team.ticket);
        }
    }
    atomic_store(&team.ticket, (uint64_t)g << 32 | CLOSED);
    while (atomic_load(&team.running) > 0) _mm_pause();  // a helper finishing the chunk it claimed
    pthread_mutex_unlock(&team.caller);
    return NULL;
}
