/* The inline atomics and the futex bell that kvflow's shared-memory rings
 * use (_lanes.pyx: the relay's lanes, several processes; _putring.pyx: the
 * put proxy's ring, one producer and one consumer), in one place (STYLE
 * rule 16). Header-only and stateless: each extension that includes it
 * gets its own copy of these functions and no state.
 *
 * Memory orders: a ring's producer fills a slot, then publishes it with a
 * release store (kvf_st_rel) of its ready word; the consumer's acquire load
 * (kvf_ld_acq) of that word makes the slot's contents visible to it. The
 * same pairing runs back for "done". Reservations that several producers
 * race for use kvf_fetch_add / kvf_cas (acq_rel: each both reads what the
 * last winner published and publishes its own claim). The __atomic
 * builtins are lock-free on 8-byte aligned words on x86-64 and aarch64,
 * which is what makes them valid across processes mapping one segment. */
#ifndef KVF_ATOMICS_H
#define KVF_ATOMICS_H

#include <linux/futex.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline unsigned long long kvf_ld_acq(unsigned long long *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void kvf_st_rel(unsigned long long *p, unsigned long long v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline unsigned long long kvf_fetch_add(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}
static inline int kvf_cas(unsigned long long *p, unsigned long long expect, unsigned long long v) {
    return __atomic_compare_exchange_n(p, &expect, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
static inline void kvf_fence_rel(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }

/* The bell: a 32-bit futex word in a shared header. Not FUTEX_PRIVATE:
 * the ringer and the sleeper may be different processes. The release
 * increment orders everything the ringer wrote before it; a sleeper that
 * read the word (kvf_bell, acquire) and then waits with that value returns
 * at once if it moved in between, so no ring is lost. */
static inline void kvf_ring(unsigned int *bell) {
    __atomic_fetch_add(bell, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, bell, FUTEX_WAKE, 1, NULL, NULL, 0);
}
static inline unsigned int kvf_bell(unsigned int *bell) { return __atomic_load_n(bell, __ATOMIC_ACQUIRE); }
static inline void kvf_wait_bell(unsigned int *bell, unsigned int seen, long timeout_ns) {
    struct timespec ts = { timeout_ns / 1000000000L, timeout_ns % 1000000000L };
    syscall(SYS_futex, bell, FUTEX_WAIT, seen, &ts, NULL, 0);
}

#endif
