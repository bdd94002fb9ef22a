# Included by _core.pyx: take_pairs, NIXL's prepped-descriptor pick and
# merge in one native pass (kvflow.engine.blocks, under peer.prepare).

cdef inline int64_t index_at(const char *base, int typenum, Py_ssize_t j) noexcept nogil:
    if typenum == cnp.NPY_INT64:
        return (<const int64_t *>base)[j]
    if typenum == cnp.NPY_INT32:
        return (<const int32_t *>base)[j]
    if typenum == cnp.NPY_UINT32:
        return (<const uint32_t *>base)[j]
    cdef uint64_t u = (<const uint64_t *>base)[j]          # NPY_UINT64
    return -1 if u > <uint64_t>INT64_MAX else <int64_t>u


cdef cnp.ndarray index_column(object values, str what):
    """`values` as a contiguous 1-D ndarray of int32, int64, uint32 or
    uint64 (no copy where it already is one)."""
    cdef cnp.ndarray arr
    cdef int t
    if isinstance(values, cnp.ndarray):
        arr = <cnp.ndarray>values
        t = cnp.PyArray_TYPE(arr)
        if cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr) and cnp.PyArray_ISNOTSWAPPED(arr) and \
                (t == cnp.NPY_INT64 or t == cnp.NPY_INT32 or t == cnp.NPY_UINT32 or t == cnp.NPY_UINT64):
            return arr
    arr = cnp.PyArray_FROM_O(values)
    if cnp.PyArray_NDIM(arr) != 1:
        raise IndexError(f"{what}: a 1-D list of indices, not {cnp.PyArray_NDIM(arr)}-D")
    if cnp.PyArray_SIZE(arr) == 0:
        return cnp.PyArray_ZEROS(1, cnp.PyArray_DIMS(arr), cnp.NPY_INT64, 0)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"{what}: integer indices, not {arr.dtype}")
    if arr.dtype.kind == "u":
        return cnp.PyArray_FROMANY(arr, cnp.NPY_UINT64, 1, 1, cnp.NPY_ARRAY_C_CONTIGUOUS)
    return cnp.PyArray_FROMANY(arr, cnp.NPY_INT64, 1, 1, cnp.NPY_ARRAY_C_CONTIGUOUS)


cdef inline bint u64_column(cnp.ndarray col):
    return cnp.PyArray_TYPE(col) == cnp.NPY_UINT64 and cnp.PyArray_NDIM(col) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(col)


cdef inline bint span_column(cnp.ndarray col, Py_ssize_t n):
    return cnp.PyArray_TYPE(col) == cnp.NPY_INT64 and cnp.PyArray_NDIM(col) == 1 and \
        cnp.PyArray_IS_C_CONTIGUOUS(col) and cnp.PyArray_DIM(col, 0) == n


cdef enum:
    PICK_STACK = 256      # take_pairs: picks built on the stack up to this many


def take_pairs(cnp.ndarray laddrs not None, cnp.ndarray llens not None, cnp.ndarray raddrs not None,
               cnp.ndarray rlens not None, local_idx, remote_idx, cnp.ndarray lspans=None,
               cnp.ndarray rspans=None):
    """Entries picked by index from two descriptor tables (a local and a
    remote one, each as contiguous uint64 address and length columns):
    returns (local_addrs, remote_addrs, lengths, mismatch), three new
    uint64 columns and the first position whose local and remote lengths
    differ (-1: none). Indices are 1-D integer arrays or lists; one outside
    its table, or counts that differ, raise IndexError naming it. NIXL's
    make_prepped_xfer in one call, without a numpy temporary.

    With lspans and rspans (int64 columns: the region each block lies in),
    consecutive picks that continue the previous entry on both sides, in the
    same regions, are merged into it (NIXL's descriptor merge): a run of
    adjacent blocks is one entry."""
    cdef Py_ssize_t nl = cnp.PyArray_DIM(laddrs, 0), nr = cnp.PyArray_DIM(raddrs, 0), k, j, m = 0
    cdef int64_t a, b, pa = -1, pb = -1
    cdef int64_t mismatch = -1
    cdef bint merge = lspans is not None and rspans is not None
    if not (u64_column(laddrs) and u64_column(llens) and u64_column(raddrs) and u64_column(rlens)):
        raise TypeError("take_pairs: the tables are contiguous 1-D uint64 columns")
    if cnp.PyArray_DIM(llens, 0) != nl or cnp.PyArray_DIM(rlens, 0) != nr:
        raise TypeError("take_pairs: a table's columns differ in length")
    cdef const int64_t *lsp = NULL
    cdef const int64_t *rsp = NULL
    if merge:
        if not span_column(lspans, nl) or not span_column(rspans, nr):
            raise TypeError("take_pairs: the span columns are contiguous 1-D int64, one per block")
        lsp = <const int64_t *>cnp.PyArray_DATA(lspans)
        rsp = <const int64_t *>cnp.PyArray_DATA(rspans)
    cdef cnp.ndarray li = index_column(local_idx, "local indices")
    cdef cnp.ndarray ri = index_column(remote_idx, "remote indices")
    k = cnp.PyArray_DIM(li, 0)
    if cnp.PyArray_DIM(ri, 0) != k:
        raise IndexError(f"{k} local and {cnp.PyArray_DIM(ri, 0)} remote indices")
    cdef cnp.npy_intp dims[1]
    cdef const char *lip = <const char *>cnp.PyArray_DATA(li)
    cdef const char *rip = <const char *>cnp.PyArray_DATA(ri)
    cdef int lt = cnp.PyArray_TYPE(li), rt = cnp.PyArray_TYPE(ri)
    cdef const uint64_t *sla = <const uint64_t *>cnp.PyArray_DATA(laddrs)
    cdef const uint64_t *sll = <const uint64_t *>cnp.PyArray_DATA(llens)
    cdef const uint64_t *sra = <const uint64_t *>cnp.PyArray_DATA(raddrs)
    cdef const uint64_t *srl = <const uint64_t *>cnp.PyArray_DATA(rlens)
    # built in scratch (the stack for up to PICK_STACK picks), then copied
    # into three columns of the merged length: one allocation each
    cdef uint64_t stack[3 * PICK_STACK]
    cdef uint64_t *dla = stack
    if k > PICK_STACK:
        dla = <uint64_t *>malloc(3 * k * sizeof(uint64_t))
        if dla == NULL:
            raise MemoryError()
    cdef uint64_t *dra = dla + (k if k > PICK_STACK else PICK_STACK)
    cdef uint64_t *dln = dra + (k if k > PICK_STACK else PICK_STACK)
    try:
        for j in range(k):
            a = index_at(lip, lt, j)
            b = index_at(rip, rt, j)
            if a < 0 or a >= nl:
                raise IndexError(f"local index {a if a >= 0 else local_idx[j]} at position {j} is outside "
                                 f"its list of {nl}")
            if b < 0 or b >= nr:
                raise IndexError(f"remote index {b if b >= 0 else remote_idx[j]} at position {j} is outside "
                                 f"its list of {nr}")
            if mismatch < 0 and sll[a] != srl[b]:
                mismatch = j
            if merge and m > 0 and lsp[a] == lsp[pa] and rsp[b] == rsp[pb] and \
                    dla[m - 1] + dln[m - 1] == sla[a] and dra[m - 1] + dln[m - 1] == sra[b]:
                dln[m - 1] += sll[a]        # continues the previous entry on both sides, in the same regions
            else:
                dla[m] = sla[a]
                dra[m] = sra[b]
                dln[m] = sll[a]
                m += 1
            pa, pb = a, b
        dims[0] = m
        la = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        ra = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        ln = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT64, 0)
        memcpy(cnp.PyArray_DATA(la), dla, m * sizeof(uint64_t))
        memcpy(cnp.PyArray_DATA(ra), dra, m * sizeof(uint64_t))
        memcpy(cnp.PyArray_DATA(ln), dln, m * sizeof(uint64_t))
    finally:
        if dla != stack:
            free(dla)
    return la, ra, ln, mismatch
