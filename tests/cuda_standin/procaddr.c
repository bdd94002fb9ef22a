// The CUDA driver stand-in (cuda_standin.h): error names and cuGetProcAddress, how cuda-bindings finds every entry point.

#include "cuda_standin.h"

/* ------------------------------------------------------------ errors by name */

static const struct { CUresult code; const char *name; } NAMES[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
};

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (NAMES[i].code == error) {
            *pStr = NAMES[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    return cuGetErrorName(error, pStr);
}


/* ------------------------------------------------------------ cuGetProcAddress */

/* (name, the version it has from, the function): a request gets the newest
   entry at or below its version. The conditional checks each function's
   type against cudaTypedefs.h's PFN type for that version. */
#define E(name, ver, fn) {#name, ver, (void *)(1 ? (fn) : (PFN_##name##_v##ver)0)}
static const struct { const char *name; int version; void *fn; } TABLE[] = {
    E(cuGetErrorName, 6000, cuGetErrorName),
    E(cuGetErrorString, 6000, cuGetErrorString),
    E(cuInit, 2000, cuInit),
    E(cuDriverGetVersion, 2020, cuDriverGetVersion),
    E(cuDeviceGet, 2000, cuDeviceGet),
    E(cuDeviceGetCount, 2000, cuDeviceGetCount),
    E(cuDeviceGetName, 2000, cuDeviceGetName),
    E(cuDeviceGetUuid, 11040, cuDeviceGetUuid),
    E(cuDeviceTotalMem, 3020, cuDeviceTotalMem),
    E(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute),
    E(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain),
    E(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease),
    E(cuCtxCreate, 12050, cuCtxCreate),
    E(cuCtxDestroy, 4000, cuCtxDestroy),
    E(cuCtxPushCurrent, 4000, cuCtxPushCurrent),
    E(cuCtxPopCurrent, 4000, cuCtxPopCurrent),
    E(cuCtxSetCurrent, 4000, cuCtxSetCurrent),
    E(cuCtxGetCurrent, 4000, cuCtxGetCurrent),
    E(cuCtxGetDevice, 2000, cuCtxGetDevice),
    E(cuCtxGetDevice, 13000, cuCtxGetDevice_v2),
    E(cuCtxSynchronize, 2000, cuCtxSynchronize),
    E(cuModuleLoadData, 2000, cuModuleLoadData),
    E(cuModuleUnload, 2000, cuModuleUnload),
    E(cuModuleGetFunction, 2000, cuModuleGetFunction),
    E(cuMemAlloc, 3020, cuMemAlloc),
    E(cuMemFree, 3020, cuMemFree),
    E(cuMemGetAddressRange, 3020, cuMemGetAddressRange),
    E(cuMemFreeHost, 2000, cuMemFreeHost),
    E(cuMemHostAlloc, 2020, cuMemHostAlloc),
    E(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer),
    E(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle),
    E(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle),
    E(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle),
    E(cuMemHostRegister, 6050, cuMemHostRegister),
    E(cuMemHostUnregister, 4000, cuMemHostUnregister),
    E(cuMemcpyHtoD, 3020, cuMemcpyHtoD),
    E(cuMemcpyDtoH, 3020, cuMemcpyDtoH),
    E(cuMemcpyAsync, 4000, cuMemcpyAsync),
    E(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync),
    E(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync),
    E(cuPointerGetAttributes, 7000, cuPointerGetAttributes),
    E(cuStreamCreate, 2000, cuStreamCreate),
    E(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority),
    E(cuStreamGetDevice, 12080, cuStreamGetDevice),
    E(cuStreamGetCtx, 9020, cuStreamGetCtx),
    E(cuStreamWaitEvent, 3020, cuStreamWaitEvent),
    E(cuStreamQuery, 2000, cuStreamQuery),
    E(cuStreamSynchronize, 2000, cuStreamSynchronize),
    E(cuStreamDestroy, 4000, cuStreamDestroy),
    E(cuEventCreate, 2000, cuEventCreate),
    E(cuEventRecord, 2000, cuEventRecord),
    E(cuEventRecordWithFlags, 11010, cuEventRecordWithFlags),
    E(cuEventQuery, 2000, cuEventQuery),
    E(cuEventSynchronize, 2000, cuEventSynchronize),
    E(cuEventDestroy, 4000, cuEventDestroy),
    E(cuStreamWriteValue64, 11070, cuStreamWriteValue64),
    E(cuLaunchKernel, 4000, cuLaunchKernel),
    E(cuLaunchHostFunc, 10000, cuLaunchHostFunc),
};

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *status)
{
    (void)flags;
    int best = -1;
    for (int i = 0; i < (int)(sizeof TABLE / sizeof TABLE[0]); i++)
        if (!strcmp(TABLE[i].name, symbol) && TABLE[i].version <= version &&
            (best < 0 || TABLE[i].version > TABLE[best].version))
            best = i;
    if (best < 0) {             /* not in the stand-in: cuda-bindings raises if it is ever called */
        *pfn = NULL;
        if (status)
            *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = TABLE[best].fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}
