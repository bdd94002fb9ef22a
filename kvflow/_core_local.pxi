# Included by _core.pyx: the local provider's channel (memcpy or
# process_vm_writev/readv) and the probes kvflow.providers.local asks
# before it picks that path.

cdef class LocalChannel(Channel):
    """The local provider toward one peer: memcpy (pid 0, same process) or
    process_vm_writev/readv into process `pid`."""

    def __init__(self, Core core, RemoteTable table, str peer, int pid, uint64_t inline_limit,
                 Core target=None, uint64_t incarnation=0):
        """target: the peer's Core when it is an engine of this process
        (pid 0); else its region fence is attached from process `pid` by
        its `incarnation` (OSError with the errno when it cannot be)."""
        cdef kvf_fence *fence
        cdef int err = 0
        if pid == 0:
            if target is None:
                raise ValueError("a same-process local channel needs the target's Core")
            fence = target._ctx().fence
            if fence == NULL:
                raise MemoryError("kvflow: the target engine has no region fence")
            kvf_fence_ref(fence, 1)
        else:
            with nogil:
                fence = kvf_fence_attach(pid, incarnation, &err)
            if fence == NULL:
                raise OSError(err, f"cannot attach the region fence of process {pid}: {os.strerror(err)}")
        self.ch = kvf_local_channel_new(core._ctx(), &table.t, pid, inline_limit, fence)
        kvf_fence_unref(fence, 1)         # the channel took its own reference
        if self.ch == NULL:
            raise MemoryError()
        self.cch = <kvf_channel *>self.ch

    def _hold(self, uint64_t addr, uint64_t length, bint write=True):
        """Tests: enters the target's fence for [addr, addr+length) as a
        copy would and stays inside (a copier stalled between its check and
        its copy) until _release() or the channel is freed. The status a
        copy would get (KVF_OK: inside)."""
        if self.ch == NULL:
            raise RuntimeError("kvflow: the channel is closed")
        return kvf_local_channel_hold(self.ch, addr, length, KVF_OP_WRITE if write else KVF_OP_READ)

    def _release(self):
        if self.ch != NULL:
            kvf_local_channel_release(self.ch)

    def __dealloc__(self):
        if self.ch != NULL:
            self.cch = NULL
            kvf_channel_free(<kvf_channel *>self.ch)
            self.ch = NULL

    @property
    def alive(self):
        return not self.closed

    def close(self):
        # the C channel stays until dealloc: a thread in submit_poll may
        # hold it; it refuses new batches from now on
        self.closed = True
        if self.ch != NULL:
            kvf_channel_close(self.cch)




def probe_process(int pid, uint64_t addr, size_t length):
    """Reads `length` bytes at `addr` in process `pid` (process_vm_readv):
    returns the bytes, or the errno as an int when not permitted."""
    cdef bytes buf = bytes(length)
    cdef int rc
    rc = kvf_local_probe(pid, addr, <char *>buf, length)
    return rc if rc else buf


def fence_probe(int pid, uint64_t incarnation):
    """0 when the region fence of engine `incarnation` in process `pid` can
    be attached (what a local channel to it needs), else the errno."""
    cdef int err = 0
    cdef kvf_fence *f
    with nogil:
        f = kvf_fence_attach(pid, incarnation, &err)
        kvf_fence_unref(f, 1)
    return 0 if f != NULL else err
