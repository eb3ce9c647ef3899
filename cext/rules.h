/* The machine side of the thread rule (cext/rules.pxd): how many OpenMP threads a parallel
 * region may have now.
 *
 * caffepy_team_limit() is omp_get_max_threads(), capped by the cores that no other runnable
 * thread wants when OpenMP threads wait passively (caffepy's default, caffepy/threads.py): a
 * region waits at its end for its slowest thread, and on a core shared with a busy process
 * that thread runs a fraction of the time (a region of 2 threads on a 2-core machine with one
 * busy process took 9-100x the time of one thread, issue 12). The runnable count is the fourth
 * field of /proc/loadavg ("running/total", the machine's, the reading thread included), read
 * at most every CAFFEPY_LOAD_PERIOD_NS. The count is a snapshot, and a busy machine's processes
 * come and go from the run queue (I/O, page faults, their own regions): the limit is the
 * smallest reading of the last CAFFEPY_LOAD_HOLD_NS, so one reading taken while the others
 * slept does not give a team that must then wait a scheduler slice for its second thread.
 * With spinning threads (OMP_WAIT_POLICY=active, or a
 * GOMP_SPINCOUNT) our own idle threads would count as load, and the user has said the cores are
 * theirs: the limit is then omp_get_max_threads() alone.
 *
 * Static: each kernel module has its own copy of the state (one read of a tiny file per module
 * per period). Several Python threads may call at once: the state is read and written with
 * relaxed atomics, and a torn update costs at most one extra read.
 */
#include <fcntl.h>
#include <omp.h>
#include <stdlib.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define CAFFEPY_LOAD_PERIOD_NS 20000000LL
#define CAFFEPY_LOAD_HOLD_NS 250000000LL

static int caffepy_adaptive = -1;      /* -1: not decided yet, then 0 or 1 */
static long long caffepy_load_read_ns = 0;
static int caffepy_free_cores = 0;
static long long caffepy_low_ns = 0;   /* when caffepy_free_cores last read this low */

static int caffepy_passive_wait(void) {
    const char* policy = getenv("OMP_WAIT_POLICY");
    const char* spin = getenv("GOMP_SPINCOUNT");
    if (spin != NULL && atoll(spin) != 0) return 0;
    return policy != NULL && strcasecmp(policy, "passive") == 0;
}

/* Runnable threads on the machine, the caller included; 0 when unknown. */
static int caffepy_runnable(void) {
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY), fields = 0, running = 0;
    ssize_t n, i;
    if (fd < 0) return 0;
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    for (i = 0; i < n && fields < 3; i++)
        if (buf[i] == ' ') fields++;
    for (; i < n && buf[i] >= '0' && buf[i] <= '9'; i++)
        running = running * 10 + (buf[i] - '0');
    return i < n && buf[i] == '/' ? running : 0;
}

static int caffepy_team_limit(void) {
    int max = omp_get_max_threads(), free_cores, adaptive;
    long long now;
    struct timespec ts;
    if (max <= 1) return 1;
    adaptive = __atomic_load_n(&caffepy_adaptive, __ATOMIC_RELAXED);
    if (adaptive < 0) {
        adaptive = caffepy_passive_wait();
        __atomic_store_n(&caffepy_adaptive, adaptive, __ATOMIC_RELAXED);
    }
    if (!adaptive) return max;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    if (now - __atomic_load_n(&caffepy_load_read_ns, __ATOMIC_RELAXED) >= CAFFEPY_LOAD_PERIOD_NS) {
        int running = caffepy_runnable();
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        int reading = running > 0 && online > 0 ? (int)(online - (running - 1)) : max;
        free_cores = __atomic_load_n(&caffepy_free_cores, __ATOMIC_RELAXED);
        if (reading <= free_cores
                || now - __atomic_load_n(&caffepy_low_ns, __ATOMIC_RELAXED) >= CAFFEPY_LOAD_HOLD_NS) {
            free_cores = reading;
            __atomic_store_n(&caffepy_free_cores, free_cores, __ATOMIC_RELAXED);
            __atomic_store_n(&caffepy_low_ns, now, __ATOMIC_RELAXED);
        }
        __atomic_store_n(&caffepy_load_read_ns, now, __ATOMIC_RELAXED);
    } else {
        free_cores = __atomic_load_n(&caffepy_free_cores, __ATOMIC_RELAXED);
    }
    return free_cores < 1 ? 1 : free_cores > max ? max : free_cores;
}
