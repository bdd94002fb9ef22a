// GPU-initiated puts, proxy mode: the device side of kvflow's put ring
// (kvflow/_putring.pyx holds the layout and the memory-order argument; the
// two must agree, and tests/test_putring.py checks they do by compiling
// this header into a host program).
//
// The ring lives in host memory mapped into the device (cuMemHostAlloc with
// DEVICEMAP); `ring` is its device address. One producer per channel: a
// block's thread 0, say, with the block's own channel; no atomics between
// producers (a system-scope atomic on host memory over PCIe is not
// guaranteed). The CPU proxy (kvflow.gpu.proxy.PutProxy) takes each
// descriptor, posts it through the engine's providers, and finishes it.
//
//   unsigned long long t = kvf_put(ring, channel, KVF_PUT, peer, local, remote, length, tag);
//   long long status = kvf_put_wait(ring, channel, t);      // 0, or a negative errno
//
// The same functions compile as host code (gcc, clang): there the fences
// are __atomic_thread_fence and the pause sched_yield. tests/test_putring.py
// builds them into a shared library and drives the proxy with them, and
// checks the layout against kvflow._putring's.
#pragma once
#include <stdint.h>
#ifndef __CUDACC__
#include <sched.h>
#endif

#define KVF_RING_MAGIC 0x3172747570666b76ULL   /* "kvfputr1" */
#define KVF_RING_HEADER 256
#define KVF_RING_CTL 128
#define KVF_RING_SLOT 64
#define KVF_PUT 1
#define KVF_GET 2
#define KVF_ECANCELED (-125)
#define KVF_ENOSLOT (-28)                       /* ENOSPC: no credit within the spin budget */

struct kvf_ring_header {                        /* HEADER bytes */
    unsigned long long magic, version, channels, slots, size, closed;
    unsigned long long pad[26];
};

struct kvf_ring_ctl {                           /* CTL bytes: two cache lines */
    unsigned long long head;                    /* line 0: the producer's */
    unsigned long long pad0[7];
    unsigned long long taken, completed, failed, fail_code;   /* line 1: the proxy's */
    unsigned long long pad1[4];
};

struct kvf_ring_slot {                          /* SLOT bytes */
    unsigned long long seq;                     /* ticket + 1: the doorbell, written last */
    unsigned int op, peer;
    unsigned long long local, remote, length, tag;
    long long status;                           /* the proxy's */
    unsigned long long done;                    /* the proxy's: ticket + 1 once finished */
};

#ifdef __CUDACC__
#define KVF_DEV __device__ __forceinline__
#define KVF_FN __device__
#define KVF_FENCE() __threadfence_system()
#define KVF_PAUSE() __nanosleep(256)
#else
#define KVF_DEV static inline
#define KVF_FN static inline
#define KVF_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define KVF_PAUSE() sched_yield()
#endif

KVF_DEV volatile struct kvf_ring_ctl *kvf_ring_channel(char *ring, unsigned int channel, unsigned int slots)
{
    return (volatile struct kvf_ring_ctl *)(ring + KVF_RING_HEADER +
        (unsigned long long)channel * (KVF_RING_CTL + (unsigned long long)slots * KVF_RING_SLOT));
}

KVF_DEV volatile struct kvf_ring_slot *kvf_ring_slot(volatile struct kvf_ring_ctl *ctl, unsigned int slots,
                                                     unsigned long long ticket)
{
    return (volatile struct kvf_ring_slot *)((volatile char *)ctl + KVF_RING_CTL +
                                             (ticket % slots) * KVF_RING_SLOT);
}

// Appends one descriptor to `channel` and rings its doorbell; returns its
// ticket, or ~0ULL if the proxy stopped while this waited for a slot. The
// caller is the channel's only producer, and has made the data it puts
// visible (a __syncthreads() after the block wrote it; this fences
// system-wide before the doorbell).
KVF_FN unsigned long long kvf_put(char *ring, unsigned int channel, unsigned int op, unsigned int peer,
                                      unsigned long long local, unsigned long long remote,
                                      unsigned long long length, unsigned long long tag)
{
    volatile struct kvf_ring_header *h = (volatile struct kvf_ring_header *)ring;
    unsigned int slots = (unsigned int)h->slots;
    volatile struct kvf_ring_ctl *ctl = kvf_ring_channel(ring, channel, slots);
    unsigned long long t = ctl->head;
    while (t >= slots && ctl->completed < t - slots + 1) {      /* the credit */
        if (h->closed)
            return ~0ULL;
        KVF_PAUSE();
    }
    KVF_FENCE();              /* completed was read before the slot is written */
    volatile struct kvf_ring_slot *s = kvf_ring_slot(ctl, slots, t);
    s->op = op;
    s->peer = peer;
    s->local = local;
    s->remote = remote;
    s->length = length;
    s->tag = tag;
    KVF_FENCE();              /* the data and the fields, before the doorbell */
    s->seq = t + 1;
    ctl->head = t + 1;
    KVF_FENCE();
    return t;
}

// Waits for ticket `t` of `channel` to finish; returns its status (0, or a
// negative errno: kvflow._putring's E_* codes), KVF_ECANCELED if the proxy
// stopped first. Valid until the channel posts `slots` more tickets.
KVF_FN long long kvf_put_wait(char *ring, unsigned int channel, unsigned long long t)
{
    volatile struct kvf_ring_header *h = (volatile struct kvf_ring_header *)ring;
    unsigned int slots = (unsigned int)h->slots;
    volatile struct kvf_ring_ctl *ctl = kvf_ring_channel(ring, channel, slots);
    if (t == ~0ULL)
        return KVF_ECANCELED;
    while (ctl->completed <= t) {
        if (h->closed)
            return KVF_ECANCELED;
        KVF_PAUSE();
    }
    KVF_FENCE();              /* completed, then the status */
    return kvf_ring_slot(ctl, slots, t)->status;
}
