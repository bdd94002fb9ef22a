"""Providers: what moves the bytes of a batch to a peer. local (memcpy in
one process, cross-memory attach on one host), tcp (data connections
over one or more rails) and rdma (verbs RC queue pairs). Each sits on a
native channel of kvflow._core or kvflow._verbs."""
