// A CUDA driver stand-in for kvflow's tests: a libcuda.so.1 that
// cuda-bindings loads on machines without a GPU. It is a test double, never
// a GPU result: tools/gpu_check.sh on a real GPU is the acceptance.
//
// What it keeps:
// - "Device memory" is host memory the CPU cannot touch at the device
//   address: cuMemAlloc reserves the address range PROT_NONE (a CPU path
//   handed a device address faults or gets EFAULT, as with a real GPU) and
//   keeps the bytes in a memfd mapped elsewhere, which only the stand-in's
//   copies and kernels reach. A freed range stays reserved, so a stale
//   device pointer never aliases later host memory.
// - CUDA IPC across processes: a handle names the exporter's pid, its memfd
//   and the allocation's serial; cuIpcOpenMemHandle maps /proc/PID/fd/FD.
//   A handle opened again by the same context is reference counted (as
//   cuda.h says); a process cannot open its own handles.
// - Contexts (primary and created), a thread-local stack of current ones;
//   streams and events belonging to a context. Each stream runs its work in
//   order on a thread of its own, so copies, event records and host
//   functions are asynchronous as on a GPU. An async fault is sticky: every
//   later call in that context returns it.
// - Misuse fails with the driver's code: CUDA_ERROR_NOT_INITIALIZED before
//   cuInit; CUDA_ERROR_INVALID_CONTEXT for a call that needs a current
//   context without one (CONTEXT_IS_DESTROYED when the current one was
//   destroyed); CUDA_ERROR_INVALID_HANDLE for a destroyed (or wrong kind of)
//   stream, event, module or function, and for work queued on a stream of
//   another context than the current one. The last is stricter than the
//   driver for copies (it lets a copy go onto another context's stream),
//   exact for kernel launches and for cuEventRecord (event and stream must
//   share a context). kvfstandin_last_error() says why a call failed.
// - kvflow's kernels, by name, as C written here (labelled: the device code
//   itself never runs): kvf_flag_write, kvf_doorbells, kvf_layer_put (its
//   puts through putring.cuh compiled for the host; blocks one after the
//   other, where a GPU runs them at once). kvf_ibgda_write has none (it
//   drives an mlx5 NIC): cuModuleGetFunction returns NOT_SUPPORTED for it.
//   The fatbin must hold sm_90 code or PTX for the stand-in's 9.0 devices.
//
// Not modelled: the legacy NULL stream's implicit synchronization with
// other streams (kvflow's streams are non-blocking), peer access, memory
// limits, stream priorities, graphs, anything about speed.
//
// Entry points: cuGetProcAddress_v2 (how cuda-bindings finds everything),
// cuDriverGetVersion (dlsym'd by cuda-bindings' version check), and the
// calls below under their ABI names; every one is checked against cuda.h's
// prototype by the compiler, and the table against cudaTypedefs.h's PFN
// types. Test hooks: kvfstandin_*.
//
// Files (compiled together into the one libcuda.so.1 by tests/_cuda_standin.py):
// this header (the shared types, the state and the helpers the parts share),
// state.c (that state, defined once; errors, handles, the current context,
// memory bookkeeping), devices.c (cuInit, devices, contexts), memory.c
// (allocations, host memory, pointer attributes, IPC), streams.c (streams,
// events, copies), kernels.c (modules, launches, kvflow's kernels as C),
// hooks.c (kvfstandin_*), procaddr.c (error names, cuGetProcAddress).
// Everything declared here is hidden: the library exports only the driver's
// entry points and the test hooks, and a helper's name (fail, get, ...)
// cannot be interposed by another library's symbol.
#ifndef KVF_CUDA_STANDIN_H
#define KVF_CUDA_STANDIN_H

#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 8
#define MAX_OBJS (1 << 20)
#define MAX_MEMS 4096
#define MAX_CTX_DEPTH 32
#define IPC_MAGIC 0x316275747366766bULL     /* "kvfstub1", little-endian */

enum { K_CTX = 1, K_STREAM, K_EVENT, K_MODULE, K_FUNC };
enum { KERN_NONE, KERN_FLAG_WRITE, KERN_DOORBELLS, KERN_LAYER_PUT, KERN_UNSUPPORTED };

struct op;

struct obj {
    int kind, alive;
    CUdeviceptr handle;
    struct obj *ctx;                /* what it belongs to (a context: itself) */
    /* context */
    int dev, primary, refs;
    CUresult sticky;
    struct obj *null_stream;
    /* stream */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    uint64_t enq, done;             /* ops queued, ops run */
    int worker;
    /* event */
    struct obj *rec_stream;
    uint64_t rec_seq;
    /* module / function */
    unsigned kernels;               /* module: the KERN_ bits its image holds */
    int kernel;
};

struct mem {
    int live, kind;                 /* M_DEVICE, M_PINNED, M_REGISTERED */
    uint64_t addr, size;
    char *shadow;                   /* device memory: where its bytes are */
    int fd, dev;
    uint64_t serial;
    struct obj *ctx;                /* device: the allocating (or importing) context */
    int imported, refs;             /* an IPC mapping: opened how many times */
    int ipc_pid; uint64_t ipc_serial;
};
enum { M_DEVICE = 1, M_PINNED, M_REGISTERED };

struct op {
    struct op *next;
    int type;
    uint64_t a, b, n;               /* copy: dst, src, n; write64: addr, value */
    void (*fn)(void *);
    void *data;
    struct obj *wait_stream;
    uint64_t wait_seq;
    int kernel;
    unsigned grid, block;
    uint64_t params[16];
};
enum { OP_COPY = 1, OP_WAIT, OP_WRITE64, OP_HOSTFN, OP_KERNEL, OP_SLEEP };

#pragma GCC visibility push(hidden)

/* state.c: the process's state, under g_mu (t_*: each thread's own) */
extern pthread_mutex_t g_mu;
extern struct obj *g_objs[MAX_OBJS];
extern int g_nobjs;
extern struct mem g_mems[MAX_MEMS];
extern int g_nmems;
extern uint64_t g_serial;
extern int g_init, g_ndev, g_phys[MAX_DEVICES];
extern struct obj *g_primary[MAX_DEVICES];
extern __thread struct obj *t_stack[MAX_CTX_DEPTH];
extern __thread int t_depth;
extern long g_copy_delay_us;
extern uint64_t g_stats[8];          /* copies, bytes, kernels, host functions, ipc opens */

/* state.c: errors, handles, the current context, memory */
CUresult fail(CUresult code, const char *fmt, ...);
struct obj *new_obj(int kind, struct obj *ctx);
struct obj *lookup(uint64_t h, int kind);
const char *kind_name(int kind);
CUresult get(uint64_t h, int kind, struct obj **out, const char *fn);
CUresult current(struct obj **out, const char *fn);
CUresult work_stream(CUstream h, struct obj **cur, struct obj **out, const char *fn);
struct mem *find_mem(uint64_t addr, int live_only);
struct mem *new_mem(void);
char *reach(uint64_t addr, uint64_t n, int pageable, CUresult *why);
int copy_bytes(char *dst, const char *src, uint64_t n);
void *reserve(int dev, uint64_t len);

/* streams.c */
void enqueue(struct obj *s, struct op *o);
CUresult stream_sync(struct obj *s);

/* kernels.c: runs on a stream's worker */
void run_kernel(struct obj *s, struct op *o);

#pragma GCC visibility pop

#define NEED_INIT() do { if (!g_init) return fail(CUDA_ERROR_NOT_INITIALIZED, "%s before cuInit", __func__); } while (0)

#endif
