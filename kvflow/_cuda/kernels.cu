// kvflow's device code, built by nvcc into kvflow_kernels.fatbin when nvcc
// is found (setup.py, KVFLOW_CUDA=auto|on|off) and loaded at run time with
// cuModuleLoadData (kvflow/_cuda/kernels.py): nothing links against it, so
// kvflow imports on machines without a driver.
//
// Doorbells and flags: a kernel (or a stream, behind the work queued before
// it) tells a CPU worker that data is ready by writing a 64-bit value into
// host-mapped memory the worker polls. The relay and GPU-initiated puts
// will add their kernels here.
#include <stdint.h>

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

}  // extern "C"
