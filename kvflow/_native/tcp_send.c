/* The tcp provider, sending: claimed slices become frames (a header each,
 * write payloads straight from registered memory) and go into the socket,
 * runs of headers and small payloads in one sendmsg() each and large write
 * payloads by page reference (vmsplice + splice: the target's ack, which
 * completes the slice, proves the pages were read). */
#define _GNU_SOURCE
#include "tcp_int.h"
#include "sockio.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

/* Frames claimed slices: the header-only frames that go first (nctl of
 * them at ctl: fences, a credit ask), then one header each, and for writes
 * the payload straight from registered memory. h has room for k + nctl
 * headers. Returns the iovec count. */
int tcp_frame_slices(const kvf_hdr *ctl, int nctl, const kvf_slice *s, size_t k, kvf_hdr *h, struct iovec *iov) {
    int niov = 0;
    for (int i = 0; i < nctl; i++) {
        *h = ctl[i];
        iov[niov++] = (struct iovec){h++, sizeof(kvf_hdr)};
    }
    for (size_t i = 0; i < k; i++) {
        int w = (s[i].op & 0xff) == KVF_OP_WRITE;
        h[i] = (kvf_hdr){KVF_MAGIC, w ? KVF_F_WRITE : KVF_F_READ_REQ,
                         (s[i].op & KVF_OP_FLUSH) ? KVF_HDR_FLUSH : 0, S_TAG(s[i]),
                         s[i].remote, s[i].len, 0};
        iov[niov++] = (struct iovec){&h[i], sizeof(kvf_hdr)};
        if (w) iov[niov++] = (struct iovec){(void *)(uintptr_t)s[i].local, s[i].len};
    }
    return niov;
}

/* iov[i] is a write payload (it follows a header) large enough to splice. */
static int tcp_is_spliced(const struct iovec *iov, int i) {
    return i > 0 && iov[i].iov_len >= SPLICE_MIN && iov[i - 1].iov_len == sizeof(kvf_hdr);
}

/* Moves len bytes at p into the socket by page reference. */
static int tcp_splice_payload(tcp_conn *c, const char *p, size_t len, int more) {
    while (len > 0) {
        struct iovec v = {(void *)p, len < c->pipe_cap ? len : c->pipe_cap};
        ssize_t k = vmsplice(c->pipe_w, &v, 1, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        len -= k;
        for (ssize_t done = 0; done < k;) {
            ssize_t m = splice(c->pipe_r, NULL, c->fd, NULL, k - done,
                               SPLICE_F_MOVE | ((more || len) ? SPLICE_F_MORE : 0));
            if (m < 0 && errno == EINTR) continue;
            if (m < 0 && errno == EAGAIN && sk_wait(c->fd, POLLOUT) == 0) continue;
            if (m <= 0) return -1;
            done += m;
        }
    }
    return 0;
}

/* Sends framed slices (blocking): runs of headers and small payloads in one
 * sendmsg each, large write payloads spliced. */
int tcp_send_frames(tcp_conn *c, struct iovec *iov, int niov) {
    if (c->pipe_w < 0) return niov ? sk_send_iov(c->fd, iov, niov) : 0;
    int start = 0;
    for (int i = 0; i < niov; i++) {
        if (!tcp_is_spliced(iov, i)) continue;
        /* iov[i] is a large payload: its header and everything before it
         * go first (MSG_MORE: the payload follows at once) */
        if (sk_send_iov_flags(c->fd, iov + start, i - start, MSG_MORE)) return -1;
        if (tcp_splice_payload(c, iov[i].iov_base, iov[i].iov_len, i + 1 < niov)) return -1;
        start = i + 1;
    }
    return start < niov ? sk_send_iov(c->fd, iov + start, niov - start) : 0;
}

/* send_frames without blocking, for the inline path. Returns how many of
 * the last iovecs are left (the first of them possibly partly sent), -1 on
 * error; *in_pipe gets the bytes left in the pipe, which must reach the
 * socket before those iovecs. */
int tcp_send_frames_nb(tcp_conn *c, struct iovec *iov, int niov, size_t *in_pipe) {
    *in_pipe = 0;
    int start = 0;
    for (int i = 0; c->pipe_w >= 0 && i < niov; i++) {
        if (!tcp_is_spliced(iov, i)) continue;
        int left = sk_send_iov_flags(c->fd, iov + start, i - start, MSG_DONTWAIT | MSG_MORE);
        if (left) return left < 0 ? -1 : left + (niov - i);
        /* the pipe is empty here: the inline path runs only then */
        struct iovec v = {iov[i].iov_base, iov[i].iov_len < c->pipe_cap ? iov[i].iov_len : c->pipe_cap};
        ssize_t k = vmsplice(c->pipe_w, &v, 1, SPLICE_F_NONBLOCK);
        if (k < 0) return (errno == EAGAIN || errno == EINTR) ? niov - i : -1;
        iov[i].iov_base = (char *)iov[i].iov_base + k;
        iov[i].iov_len -= k;
        /* MORE only when frames follow: on the last payload it would hold
         * back the tail segment (up to the kernel's 200 ms cork timer) */
        ssize_t m = splice(c->pipe_r, NULL, c->fd, NULL, k,
                           SPLICE_F_MOVE | SPLICE_F_NONBLOCK | ((i + 1 < niov || iov[i].iov_len) ? SPLICE_F_MORE : 0));
        if (m < 0) {
            if (errno != EAGAIN && errno != EINTR) return -1;
            m = 0;
        }
        if (m < k || iov[i].iov_len) {
            *in_pipe = (size_t)(k - m);
            return iov[i].iov_len ? niov - i : niov - i - 1;
        }
        start = i + 1;
    }
    return start < niov ? sk_send_iov_flags(c->fd, iov + start, niov - start, MSG_DONTWAIT) : 0;
}

/* Moves `n` bytes already in the pipe to the socket (blocking); `more`:
 * frames follow at once (else the tail is not held back). */
int tcp_drain_pipe(tcp_conn *c, size_t n, int more) {
    while (n > 0) {
        ssize_t m = splice(c->pipe_r, NULL, c->fd, NULL, n, SPLICE_F_MOVE | (more ? SPLICE_F_MORE : 0));
        if (m < 0 && errno == EINTR) continue;
        if (m < 0 && errno == EAGAIN && sk_wait(c->fd, POLLOUT) == 0) continue;
        if (m <= 0) return -1;
        n -= m;
    }
    return 0;
}

/* The connection's splice pipe (none: payloads are copied instead). */
void tcp_conn_open_pipe(tcp_conn *c) {
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) == 0) {
        c->pipe_r = pfd[0];
        c->pipe_w = pfd[1];
        int cap = fcntl(pfd[1], F_SETPIPE_SZ, PIPE_BYTES);
        if (cap < 0) cap = fcntl(pfd[1], F_GETPIPE_SZ);
        c->pipe_cap = cap > 0 ? (size_t)cap : 65536;
    }
}

void tcp_conn_close_pipe(tcp_conn *c) {
    if (c->pipe_r >= 0) { close(c->pipe_r); close(c->pipe_w); c->pipe_r = c->pipe_w = -1; }
}
