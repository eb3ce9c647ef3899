/* The machine side of the thread rule (cext/rules.pxd): how many OpenMP threads a parallel
 * region may have now.
 *
 * caffepy_team_limit() is omp_get_max_threads(), capped by the cores that other processes leave
 * free: a region waits at its end for its slowest thread, and on a core shared with a busy
 * process that thread runs a fraction of the time (a region of 2 threads on a 2-core machine
 * with one busy process took 9-100x the time of one thread, issue 12).
 *
 * Other processes' load is their share of the machine's CPU time: /proc/stat's busy time less
 * this process's own CPU time, over the last CAFFEPY_LOAD_WINDOW_NS, in cores. A core counts as
 * taken when they use more than CAFFEPY_TAKEN_SHARE of it (sampled every 200 ms while LeNet
 * trained on 2 cores: one busy process read 0.85-1.05, an idle machine -0.09 to 0.18, the
 * clock-tick granularity of /proc/stat). Our own threads never count, however they wait:
 * caffepy's idle threads spin briefly after a region (caffepy/threads.py), which a snapshot of
 * the run queue (/proc/loadavg) would take for other processes' load. A window older than
 * CAFFEPY_STALE_NS (the first, or one this module left open while the process did other things)
 * says what the machine did then, not now: a process that kept a core busy all through a pause
 * and has just ended would cost us the cores for a window (AlexNet b64: its first iteration
 * after a 4 s pause beside a memory-streaming process took 1100-1230 ms, 780 ms with every
 * thread). Such a window gives way to a snapshot: the run queue less our own runnable threads.
 *
 * With OMP_WAIT_POLICY=active the user has said the cores are theirs: the limit is then
 * omp_get_max_threads() alone.
 *
 * Static: each kernel module has its own copy of the state (one read of two small files per
 * module per window). Several Python threads may call at once: the state is read and written
 * with relaxed atomics, and a torn update costs at most one window's reading.
 */
#include <dirent.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define CAFFEPY_LOAD_WINDOW_NS 200000000LL
#define CAFFEPY_STALE_NS (2 * CAFFEPY_LOAD_WINDOW_NS)
#define CAFFEPY_TAKEN_SHARE 0.4

static int caffepy_adaptive = -1;      /* -1: not decided yet, then 0 or 1 */
static long long caffepy_window_ns = 0;        /* when the current window began; 0: never */
static long long caffepy_window_busy_ns = 0;   /* the machine's busy CPU time then */
static long long caffepy_window_own_ns = 0;    /* this process's CPU time then */
static int caffepy_free_cores = 0;

static int caffepy_read(const char* path, char* buf, int size) {
    int fd = open(path, O_RDONLY);
    ssize_t n;
    if (fd < 0) return 0;
    n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return (int)n;
}

/* Runnable threads on the machine, the caller included; 0 when unknown. */
static int caffepy_runnable(void) {
    char buf[128];
    int n = caffepy_read("/proc/loadavg", buf, sizeof buf), fields = 0, running = 0, i;
    for (i = 0; i < n && fields < 3; i++)
        if (buf[i] == ' ') fields++;
    for (; i < n && buf[i] >= '0' && buf[i] <= '9'; i++)
        running = running * 10 + (buf[i] - '0');
    return i < n && buf[i] == '/' ? running : 0;
}

/* This process's threads that are runnable now (state R in /proc/self/task/<tid>/stat), the
 * caller included; 1 when unknown. */
static int caffepy_own_runnable(void) {
    char path[300], buf[512], *end;
    struct dirent* entry;
    DIR* dir = opendir("/proc/self/task");
    int running = 0, n;
    if (dir == NULL) return 1;
    while ((entry = readdir(dir)) != NULL) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", entry->d_name);
        n = caffepy_read(path, buf, sizeof buf);
        end = n > 0 ? strrchr(buf, ')') : NULL;     /* the name may hold spaces and ')' */
        if (end != NULL && end[1] == ' ' && end[2] == 'R') running++;
    }
    closedir(dir);
    return running > 0 ? running : 1;
}

/* Other processes' runnable threads now, or -1 when unknown: the run queue less our own
 * runnable threads, the least of three readings. A reading can only come out too high: a
 * thread of ours that was spinning after a region and falls asleep between the two reads
 * (AlexNet's conv1, after a pause, read a core taken that way), or a kernel thread that runs
 * for a few microseconds (rcu_preempt was in one reading of five after a process ended),
 * while a busy process is in every reading. Three take ~0.3 ms (the /proc reads), once per
 * module per pause. */
static int caffepy_others_runnable(void) {
    int least = -1, reading, running, own, others;
    for (reading = 0; reading < 3; reading++) {
        running = caffepy_runnable();
        own = caffepy_own_runnable();
        if (running <= 0) return -1;
        others = running > own ? running - own : 0;
        if (least < 0 || others < least) least = others;
    }
    return least;
}

/* The machine's busy CPU time in ns (/proc/stat's first line: user, nice, system, irq and
 * softirq; guest time is inside user), or -1 when unknown. */
static long long caffepy_machine_busy_ns(void) {
    char buf[512];
    int n = caffepy_read("/proc/stat", buf, sizeof buf), field = 0, i = 3;
    long long v, busy = 0, tick = sysconf(_SC_CLK_TCK);
    if (n < 4 || buf[0] != 'c' || buf[1] != 'p' || buf[2] != 'u' || tick <= 0) return -1;
    while (field < 7) {
        while (i < n && buf[i] == ' ') i++;
        if (i >= n || buf[i] < '0' || buf[i] > '9') return -1;
        for (v = 0; i < n && buf[i] >= '0' && buf[i] <= '9'; i++) v = v * 10 + (buf[i] - '0');
        if (field != 3 && field != 4) busy += v;     /* not idle, not iowait */
        field++;
    }
    return busy * (1000000000LL / tick);
}

static long long caffepy_clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int caffepy_user_spins(void) {
    const char* policy = getenv("OMP_WAIT_POLICY");
    return policy != NULL && strcasecmp(policy, "active") == 0;
}

static int caffepy_team_limit(void) {
    int max = omp_get_max_threads(), free_cores, adaptive;
    long long now, start, busy, own;
    long online;
    if (max <= 1) return 1;
    adaptive = __atomic_load_n(&caffepy_adaptive, __ATOMIC_RELAXED);
    if (adaptive < 0) {
        adaptive = !caffepy_user_spins();
        __atomic_store_n(&caffepy_adaptive, adaptive, __ATOMIC_RELAXED);
    }
    if (!adaptive) return max;
    now = caffepy_clock_ns(CLOCK_MONOTONIC);
    start = __atomic_load_n(&caffepy_window_ns, __ATOMIC_RELAXED);
    if (start == 0 || now - start >= CAFFEPY_LOAD_WINDOW_NS) {
        online = sysconf(_SC_NPROCESSORS_ONLN);
        busy = caffepy_machine_busy_ns();
        own = caffepy_clock_ns(CLOCK_PROCESS_CPUTIME_ID);
        if (start == 0 || now - start >= CAFFEPY_STALE_NS || busy < 0) {
            int others = caffepy_others_runnable();
            free_cores = others >= 0 && online > 0 ? (int)(online - others) : max;
        } else {
            double others = (double)((busy - caffepy_window_busy_ns)
                                     - (own - caffepy_window_own_ns)) / (double)(now - start);
            int taken = others > 0 ? (int)(others + 1.0 - CAFFEPY_TAKEN_SHARE) : 0;
            free_cores = online > 0 ? (int)(online - taken) : max;
        }
        __atomic_store_n(&caffepy_free_cores, free_cores, __ATOMIC_RELAXED);
        __atomic_store_n(&caffepy_window_busy_ns, busy, __ATOMIC_RELAXED);
        __atomic_store_n(&caffepy_window_own_ns, own, __ATOMIC_RELAXED);
        __atomic_store_n(&caffepy_window_ns, now, __ATOMIC_RELAXED);
    } else {
        free_cores = __atomic_load_n(&caffepy_free_cores, __ATOMIC_RELAXED);
    }
    return free_cores < 1 ? 1 : free_cores > max ? max : free_cores;
}
