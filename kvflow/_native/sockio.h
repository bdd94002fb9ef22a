/* Socket helpers shared by the tcp initiator and target: gathered sends
 * and a buffered frame reader. */
#ifndef KVF_SOCKIO_H
#define KVF_SOCKIO_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>
#include "wire.h"

#define RD_BUF (256u << 10)

typedef void (*sk_flush_fn)(void *);

/* A buffered sk_reader: small frames come out of one big recv(); large payloads
 * are received straight into their destination. When the peer is idle
 * between frames, `flush` runs (the server sends its pending acks then). */
typedef struct {
    int fd;
    char *buf;
    size_t pos, end;
    sk_flush_fn flush;
    void *arg;
    int big;       /* the last payload was large: the next one likely is too */
    int idle_poll; /* wait for a frame with poll(): SO_RCVTIMEO then bounds a frame */
    uint64_t deadline_ns;  /* CLOCK_MONOTONIC; 0: none. Past it, reads fail */
    int nonblocking;       /* fd is O_NONBLOCK: wait in poll() instead of failing on EAGAIN */
    uint64_t spin_ns;      /* idle_poll: look again this long (yielding) before sleeping in poll() */
    int spin_armed;        /* ... when the last frame ended a batch (set by the caller, cleared here) */
    /* nonzero: a frame's deadline and SO_RCVTIMEO end the read only when
     * the peer's kernel stopped answering too (sk_heard); a peer that is
     * merely stopped or starved is waited for. 0: they always do. */
    uint32_t grace_ms;
    int unheard;           /* sk_heard's last look found the peer unanswered */
    /* nonzero: bytes are read into the caller's memory (a payload, a
     * header) only from a connection seen not reset by its peer within
     * the last fresh_ns, looked at again (TCP_INFO) when that is older
     * (sockio.c: sk_not_reset). 0: never looked at. */
    uint64_t fresh_ns;
    uint64_t open_ns;      /* CLOCK_MONOTONIC of the last look that found it open */
} sk_reader;

/* Waits until fd is readable/writable (`events`); -1 on error. */
int sk_wait(int fd, short events);

uint64_t sk_now_ns(void);

/* On an O_NONBLOCK socket without MSG_DONTWAIT, it waits in poll() when the
 * socket is full (the initiator's sockets are non-blocking so that its
 * event loop can splice into them without ever blocking). */
int sk_send_iov_flags(int fd, struct iovec *iov, int n, int flags);
/* sk_send_iov that gives up (-1) once CLOCK_MONOTONIC passes deadline_ns;
 * the socket needs SO_SNDTIMEO so that one call cannot outlast it much.
 * With grace_ms, past the deadline it goes on while the peer is still
 * heard (sk_heard): a receiver that stopped reading is slow, not gone. */
int sk_send_iov_until(int fd, struct iovec *iov, int n, uint64_t deadline_ns, uint32_t grace_ms);
int sk_send_iov(int fd, struct iovec *iov, int n);
int sk_send_all(int fd, const void *p, size_t n);
/* Reads exactly n bytes into dst (dst NULL: discard them). */
int sk_read_exact(sk_reader *r, void *dst, size_t n);
int sk_read_header(sk_reader *r, kvf_hdr *h);
void sk_nodelay(int fd);
/* 1 when the peer's kernel has answered nothing on fd for grace_ms while
 * something waits for an answer (sockio.c says what counts). */
int sk_unanswered(int fd, uint32_t grace_ms);
/* 0 when this look and the one before (*unheard carries it) both found fd
 * unanswered for grace_ms: the peer is gone; 1 while it is heard. */
int sk_heard(int fd, uint32_t grace_ms, int *unheard);
#endif
