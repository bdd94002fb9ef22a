// kvflow's device code, built by nvcc into kvflow_kernels.fatbin when nvcc
// is found (setup.py, KVFLOW_CUDA=auto|on|off) and loaded at run time with
// cuModuleLoadData (kvflow/_cuda/kernels.py): nothing links against it, so
// kvflow imports on machines without a driver.
//
// Doorbells and flags: a kernel (or a stream, behind the work queued before
// it) tells a CPU worker that data is ready by writing a 64-bit value into
// host-mapped memory the worker polls. GPU-initiated puts (proxy mode):
// putring.cuh, and kvf_layer_put below, the example of a kernel using it.
#include <stdint.h>
#include "putring.cuh"
#include "ibgda.cuh"

extern "C" {

// Writes `value` into *flag after every write this grid made before it is
// visible system-wide (to the CPU and to peers over PCIe/NVLink). One thread.
__global__ void kvf_flag_write(volatile unsigned long long *flag, unsigned long long value)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        __threadfence_system();
        *flag = value;
        __threadfence_system();
    }
}

// Rings `count` doorbells: doorbell[i] = values[i], in index order, each
// after the writes before it are visible system-wide.
__global__ void kvf_doorbells(volatile unsigned long long *doorbell, const unsigned long long *values,
                              unsigned int count)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        __threadfence_system();
        for (unsigned int i = 0; i < count; i++) {
            doorbell[i] = values[i];
            __threadfence_system();
        }
    }
}

// The example of a GPU-initiated put (issue 21, proxy mode): a kernel
// that computes a layer's KV and puts it from the device. Block b computes
// rows [b * rows_per_block, ...) of kv = x @ w (x: rows x dim_in, w:
// dim_in x dim_out, row-major floats, kv in registered device memory),
// then its thread 0 puts those rows to remote_base + the same offset
// through channel b of the ring (peer index `peer` in the proxy's table),
// waits for them to land, and writes out[2b] = the status, out[2b + 1] =
// the nanoseconds from its put to its completion (%globaltimer). Every
// argument is 64 bits wide (kernels.py passes 8-byte slots).
__global__ void kvf_layer_put(const float *x, const float *w, float *kv, unsigned long long rows,
                              unsigned long long dim_in, unsigned long long dim_out,
                              unsigned long long rows_per_block, char *ring, unsigned long long peer,
                              unsigned long long remote_base, long long *out)
{
    unsigned long long first = (unsigned long long)blockIdx.x * rows_per_block;
    unsigned long long last = first + rows_per_block < rows ? first + rows_per_block : rows;
    for (unsigned long long i = first * dim_out + threadIdx.x; i < last * dim_out; i += blockDim.x) {
        unsigned long long r = i / dim_out, c = i % dim_out;
        float acc = 0.f;
        for (unsigned long long k = 0; k < dim_in; k++)
            acc += x[r * dim_in + k] * w[k * dim_out + c];
        kv[i] = acc;
    }
    __syncthreads();
    if (threadIdx.x != 0 || first >= last)
        return;
    unsigned long long off = first * dim_out * sizeof(float), len = (last - first) * dim_out * sizeof(float);
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    unsigned long long ticket = kvf_put(ring, blockIdx.x, KVF_PUT, (unsigned int)peer,
                                        (unsigned long long)kv + off, remote_base + off, len, blockIdx.x);
    long long status = kvf_put_wait(ring, blockIdx.x, ticket);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    out[2 * blockIdx.x] = status;
    out[2 * blockIdx.x + 1] = (long long)(t1 - t0);
}

// IBGDA (never run on hardware: ibgda.cuh): one RDMA write posted by the
// device itself on an mlx5 RC QP, its lkey found by address in the sorted
// region table, then the CQ polled for its completion; out[0] = the CQE's
// opcode (0: done) or -1 (no region holds the range), out[1] = its WQE
// counter. One thread.
__global__ void kvf_ibgda_write(struct kvf_ibgda_qp *qp, const struct kvf_mr *mrs, int nmrs,
                                unsigned long long laddr, unsigned long long raddr, unsigned int rkey,
                                unsigned int len, long long *out)
{
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    int mr = kvf_mr_lookup(mrs, nmrs, laddr, len);
    if (mr < 0) {
        out[0] = -1;
        return;
    }
    kvf_ibgda_post_write(qp, laddr, mrs[mr].lkey, raddr, rkey, len);
    uint16_t counter = 0;
    int opcode;
    while ((opcode = kvf_ibgda_poll_cq(qp, &counter)) < 0)
        __nanosleep(128);
    out[0] = opcode;
    out[1] = counter;
}

}  // extern "C"
