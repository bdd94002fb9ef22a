"""The local socket between dummy clients and their real client
(`python -m kvflow.compat.mooncake.client`): where it is, its frames, and
how results and errors cross it.

The socket is an abstract unix socket named after the real client's port
(`@kvflow_mooncake_client_<port>`, as Mooncake's real client listens on
`@mooncake_client_<port>.sock` beside its RPC port): only a process on the
same host (and network namespace) reaches it, which shared memory needs
anyway, and a descriptor can ride along (SCM_RIGHTS) with the request that
maps it. The real client serves only peers of its own user (SO_PEERCRED).

A frame is an 8-byte big-endian length and a msgpack body:
request [method, args, kwargs], reply [0, result] or [1, error]. A batch
call is one request and one reply; an item's own failure travels in the
result as the error it is (ext type 1: its class name and message, decoded
into the same kvflow class), so the dummy's MooncakeDistributedStore turns
it into the same Mooncake code the real client's would."""
from __future__ import annotations

import array
import dataclasses
import os
import socket
import struct
from typing import Any

import msgpack

from kvflow import errors as _kvflow_errors
from kvflow.errors import KVFlowError, ProtocolError
from kvflow.store import errors as _store_errors
from kvflow.store.task_calls import ReplicaDesc, TaskInfo, TaskStatus, TaskType

__all__ = ["MAX_FDS", "MAX_FRAME", "decode", "encode", "recv_frame", "send_frame", "socket_name"]

MAX_FRAME = 1 << 36         # bytes put/get travel inline; the peer is a process of the same user
MAX_FDS = 4
_LEN = struct.Struct(">Q")
_ERR, _DATA = 1, 2
_ERRORS: dict[str, type[KVFlowError]] = {
    name: cls for mod in (_kvflow_errors, _store_errors) for name, cls in vars(mod).items()
    if isinstance(cls, type) and issubclass(cls, KVFlowError)}
_DATACLASSES = {"TaskInfo": TaskInfo, "ReplicaDesc": ReplicaDesc}


def socket_name(port: int) -> bytes:
    """The real client's abstract socket address for `port`."""
    return b"\0kvflow_mooncake_client_%d" % int(port)


def _default(obj: Any) -> Any:
    if isinstance(obj, BaseException):
        name = type(obj).__name__ if isinstance(obj, KVFlowError) else "KVFlowError"
        msg = str(obj) if isinstance(obj, KVFlowError) else f"{type(obj).__name__}: {obj}"
        return msgpack.ExtType(_ERR, msgpack.packb([name, msg, getattr(obj, "key", None)]))
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _DATACLASSES:
        fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return msgpack.ExtType(_DATA, msgpack.packb([type(obj).__name__, fields], default=_default))
    if isinstance(obj, (memoryview, bytearray)):
        return bytes(obj)
    raise TypeError(f"cannot send a {type(obj).__name__}")


def _error(name: str, msg: str, key: str | None) -> KVFlowError:
    cls = _ERRORS.get(name, KVFlowError)
    if issubclass(cls, _store_errors.StoreError):
        return cls(msg, key=key)
    try:
        return cls(msg)
    except TypeError:           # a class whose constructor takes more
        return KVFlowError(msg)


def _ext(code: int, data: bytes) -> Any:
    if code == _ERR:
        name, msg, key = msgpack.unpackb(data, raw=False)
        return _error(name, msg, key)
    if code == _DATA:
        name, fields = msgpack.unpackb(data, raw=False, ext_hook=_ext)
        if name == "TaskInfo":
            tid, kind, status, *rest = fields
            return TaskInfo(tuple(tid), TaskType(kind), TaskStatus(status), *rest)
        return _DATACLASSES[name](*fields)
    raise ProtocolError(f"unknown ext type {code}")


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_default)


def decode(body: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_ext)
    except Exception as e:          # msgpack raises several unrelated types
        raise ProtocolError(f"malformed frame: {e}") from None


def send_frame(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    body = encode(obj)
    head = _LEN.pack(len(body))
    if fds:
        # the descriptors ride with the frame's first bytes
        sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        sock.sendall(body)
    else:
        sock.sendall(head + body)


def _recv_into(sock: socket.socket, view: memoryview, fds: list[int]) -> None:
    got = 0
    room = socket.CMSG_SPACE(MAX_FDS * 4)
    while got < len(view):
        n, anc, _flags, _addr = sock.recvmsg_into([view[got:]], room)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[:len(data) - len(data) % a.itemsize])
                fds.extend(a)
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n


def recv_frame(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors that came with it; EOFError at
    the end of the stream."""
    fds: list[int] = []
    head = bytearray(_LEN.size)
    _recv_into(sock, memoryview(head), fds)
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    body = bytearray(n)
    try:
        _recv_into(sock, memoryview(body), fds)
        return decode(body), fds
    except BaseException:
        for fd in fds:          # a frame that did not arrive whole keeps none
            os.close(fd)
        raise
