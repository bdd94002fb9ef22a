/* The local provider's region fence: how an engine learns that no peer on
 * its host still copies into (or out of) a region it deregisters.
 *
 * A same-host peer moves bytes with memcpy (same process) or
 * process_vm_writev/readv (another process): the target takes no part in
 * the copy and cannot revoke it, and the peer checks its ranges against
 * its own copy of the target's region table, which a deregister updates
 * later (another process: when the pushed frame arrives) or not before
 * slices already queued run. So the target publishes the truth, and the
 * peers announce themselves, in one small record per target engine, in
 * shared memory (a memfd, which a peer in another process maps at connect
 * through /proc/<pid>/fd: the same ptrace permission as process_vm_writev):
 *
 *  - entries: the target's live regions (address, length, access, id),
 *    sorted by address, under a sequence counter (a seqlock: the target
 *    writes, peers only read, and never block the target);
 *  - slots: one word per copy in progress, "region rid, writer process
 *    pid", claimed by the copying thread for the length of one run.
 *
 * A copier claims a slot naming the region it found in the entries, checks
 * that the sequence counter has not moved since that lookup, copies, and
 * frees the slot. A deregister takes the region out of the entries (the
 * counter moves) and then waits until no slot names it. The counter's
 * store and the slot's claim are the two stores of a Dekker pair (every
 * one of the four accesses seq_cst): either the copier sees the counter
 * moved (it looks again and finds the region gone), or the deregister
 * sees its slot (and waits for it to be freed). See fence.c.
 *
 * A copier that never frees its slot (its process stopped, or preempted
 * for longer than the wait) is waited for a bounded time: a dead process
 * copies nothing more and its slot is taken back; a live one is reported
 * (kvf_fence_quiesce's pids), and the region's memory must be kept aside
 * until it has left (kvflow.RegionBusyError). */
#ifndef KVF_FENCE_H
#define KVF_FENCE_H

#include <stddef.h>
#include <stdint.h>

/* Copies in progress at once toward one engine, from every process: a
 * writer's thread holds a slot only while it copies one run. */
#define KVF_FENCE_SLOTS 256
/* Live regions one engine may have (register() refuses more): 24 bytes
 * each in the record, whose untouched pages cost nothing. */
#define KVF_FENCE_REGIONS 65536

typedef struct kvf_fence kvf_fence;

/* A pass through the fence: held while one run of slices copies. */
typedef struct {
    void *slot;              /* the claimed slot (NULL: none held) */
    uint64_t lo, hi;         /* the region it names: [lo, hi) */
} kvf_fence_pass;

/* The record of an engine (its memfd; where memfd_create fails, private
 * memory, which fences peers of this process only: kvf_fence_fd -1). */
kvf_fence *kvf_fence_create(void);
/* Names the record's engine (its incarnation): what a peer attaching
 * from another process checks it found the right one by. */
void kvf_fence_set_incarnation(kvf_fence *f, uint64_t incarnation);
int kvf_fence_fd(const kvf_fence *f);
/* Maps the record of the engine `incarnation` in process pid. NULL with
 * *err an errno (EACCES, ENOENT: none found, ...) when it cannot. */
kvf_fence *kvf_fence_attach(int pid, uint64_t incarnation, int *err);
void kvf_fence_ref(kvf_fence *f, int64_t n);
void kvf_fence_unref(kvf_fence *f, int64_t n);

/* Target side (one engine; any thread, serialised inside). */
int kvf_fence_add(kvf_fence *f, uint32_t rid, uint64_t addr, uint64_t len, uint32_t access);
/* Takes region rid out of the entries (no copy enters it from now on);
 * 1 if it was there. */
int kvf_fence_remove(kvf_fence *f, uint32_t rid);
/* Every region out (the engine is closing). */
void kvf_fence_clear(kvf_fence *f);
/* After kvf_fence_remove: waits until no copy is inside region rid, at
 * most timeout_ns. Returns how many copiers were still inside then (0:
 * none), their pids in pids[] (at most max of them). A copier whose
 * process is gone is not waited for. */
int kvf_fence_quiesce(kvf_fence *f, uint32_t rid, uint64_t timeout_ns, int *pids, int max);
/* Slots in use now (a balance the tests check). */
int kvf_fence_busy_slots(const kvf_fence *f);

/* Copier side. Enters the region holding [addr, addr+len) with the access
 * op needs (KVF_OP_*): KVF_OK and *p held, or KVF_EREMOTE (no such region
 * any more, or not that access), or KVF_ELOST (the target's record stayed
 * mid-update for a second: its process stopped or died there). */
int kvf_fence_enter(kvf_fence *f, uint64_t addr, uint64_t len, int op, kvf_fence_pass *p);
/* Whether [addr, addr+len) lies in the region p holds. */
static inline int kvf_fence_covers(const kvf_fence_pass *p, uint64_t addr, uint64_t len) {
    return addr >= p->lo && len <= p->hi - addr;
}
/* Leaves: every byte the copy moved is ordered before (release). */
void kvf_fence_leave(kvf_fence_pass *p);

#endif
