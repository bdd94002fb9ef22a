/* The tcp data-connection wire format.
 *
 * Every frame starts with one fixed 32-byte little-endian header; WRITE and
 * READ_RESP carry `len` payload bytes right after it. A fixed header lets the
 * sender put header and payload in one sendmsg() straight from registered
 * memory, and lets the receiver check the destination range before a single
 * payload byte is read. */
#ifndef KVF_WIRE_H
#define KVF_WIRE_H
#include <stdint.h>

#define KVF_MAGIC 0x464b        /* "KF" */
#define KVF_WIRE_VERSION 2   /* 2: KVF_F_FENCE */
/* Largest payload one frame may carry; a larger length is a protocol error
 * (it guards the receiver against garbage that parses as a header). */
#define KVF_MAX_PAYLOAD (64ull << 20)

enum {
    KVF_F_HELLO = 1,      /* client -> server: addr,aux = session token; len = version;
                           * tag = role (KVF_ROLE_*), status = data connection index */
    KVF_F_HELLO_ACK = 2,  /* server -> client: status 0 = accepted; aux = the target's
                           * receive window (0: no credits) */
    KVF_F_WRITE = 3,      /* addr,len + payload: land it at addr; status KVF_HDR_FLUSH:
                           * the last of its batch here, send the pending acks now */
    KVF_F_WRITE_ACK = 4,  /* tag, status; aux = index of the data connection it answers */
    KVF_F_READ_REQ = 5,   /* tag, addr, len: send me these bytes */
    KVF_F_READ_RESP = 6,  /* tag, status, len + payload */
    /* Receiver credits (credit.h), when the target's HELLO_ACK carried a
     * window in aux; header-only frames on a data connection: */
    KVF_F_CREDIT_ASK = 7,    /* initiator -> target: addr = unspent bytes handed back,
                              * aux = bytes more wanted, tag = its slice size, status
                              * KVF_ASK_BLOCKED: it stopped for credit (needs one slice now) */
    KVF_F_CREDIT_GRANT = 8,  /* target -> initiator: addr = bytes granted */
    KVF_F_CREDIT_RECALL = 9, /* target -> initiator: hand back what is not spent (addr: held) */
    /* initiator -> target, header only, before the slices a failed
     * connection's work moved onto: status = that connection's hello byte
     * (index and epoch). The target stops applying what it still reads
     * from that connection, and waits for a payload it is landing from it,
     * before it reads on: nothing of the old connection lands after the
     * slices sent again (tcp_server.c, srv_fence). */
    KVF_F_FENCE = 10,
};

/* Roles of a connection. Write acks travel on the session's ack connection
 * (when it has one), which the initiator's event loop reads directly: one
 * thread wake-up less per small write than a receiver thread plus eventfd. */
enum { KVF_ROLE_DATA = 0, KVF_ROLE_ACK = 1 };

/* A data connection's hello `status` byte: its index (bits 0-5) and the
 * epoch of the connection (bits 6-7: how many times that index was
 * rebuilt, mod 4); the target echoes the byte in each ack's aux, so an ack
 * of a replaced connection is recognised. */
#define KVF_CONN_INDEX_MASK 0x3f
#define KVF_CONN_EPOCH_SHIFT 6
#define KVF_CONN_EPOCH_MAX 3

#define KVF_HDR_FLUSH 1
#define KVF_ASK_BLOCKED 1

typedef struct {
    uint16_t magic;
    uint8_t type;
    uint8_t status;       /* KVF_* status code for acks and responses */
    uint32_t tag;         /* the initiator's in-flight slot */
    uint64_t addr;
    uint64_t len;
    uint64_t aux;
} kvf_hdr;

_Static_assert(sizeof(kvf_hdr) == 32, "wire header must be 32 bytes");
#endif
