"""The sockets of same-host segments (shmseg.py): where a holder serves its
segment, how a reader asks for it, and the one thread per client that
waits on them.

A holder listens on an abstract unix socket named after its engine's
address (only a process in the same network namespace reaches it; the
address is unique on a host while the engine lives). A reader connects,
checks the server is a process of its own user (SO_PEERCRED), and says
HELLO; the holder checks the same of the reader, and answers with one
JSON message, {"base", "size"} with a descriptor of the segment
(SCM_RIGHTS), or {"error"} and no descriptor. The connection then stays
open, silent: its end tells the reader that the holder went (killed,
closed), and the holder that the reader did.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["HELLO", "Watcher", "ask", "serve", "socket_name"]

HELLO = b"kvflow-store-shm/1\n"
_PEERCRED = struct.Struct("3i")       # pid, uid, gid
HANDSHAKE_TIMEOUT = 2.0               # seconds a peer has to say its part


def socket_name(engine_address: str) -> bytes:
    """The abstract socket a holder whose engine is at `engine_address`
    serves its segment on."""
    return b"\0kvflow_store_shm_" + hashlib.sha1(engine_address.encode()).hexdigest()[:24].encode()


def peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end (the kernel's word)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


class Watcher(threading.Thread):
    """Waits on a client's sockets and calls each one's callback, on this
    thread, when it is readable; a callback returning True has its socket
    forgotten and closed. Sockets are added and dropped from any thread."""

    def __init__(self) -> None:
        super().__init__(name="kvflow-store-shm", daemon=True)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._changes: list[tuple[socket.socket, Callable[[socket.socket], bool] | None]] = []
        self._stopping = False

    def watch(self, sock: socket.socket, callback: Callable[[socket.socket], bool]) -> None:
        self._change(sock, callback)

    def forget(self, sock: socket.socket) -> None:
        """Stops watching `sock` and closes it (on this thread)."""
        self._change(sock, None)

    def _change(self, sock: socket.socket, callback: Callable[[socket.socket], bool] | None) -> None:
        with self._lock:
            if self._stopping:
                sock.close()
                return
            self._changes.append((sock, callback))
        self._wake_w.send(b"x")

    def run(self) -> None:
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in self._sel.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                    if not self._apply():
                        return
                    continue
                if key.data(sock):
                    self._close(sock)

    def _apply(self) -> bool:
        """Takes the changes asked for; False once stopping (every socket
        then closed)."""
        with self._lock:
            changes, self._changes = self._changes, []
            stopping = self._stopping
        for sock, callback in changes:
            if callback is None:
                self._close(sock)
            elif sock.fileno() >= 0:
                self._sel.register(sock, selectors.EVENT_READ, callback)
        if stopping:
            for key in list(self._sel.get_map().values()):
                if key.fileobj is not self._wake_r:
                    self._close(key.fileobj)
            self._sel.close()
            self._wake_r.close()
        return not stopping

    def _close(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        sock.close()

    def stop(self) -> None:
        """Closes every socket watched and ends the thread."""
        with self._lock:
            self._stopping = True
        self._wake_w.send(b"x")
        if self.is_alive():
            self.join(5.0)
        self._wake_w.close()


def serve(watcher: Watcher, engine_address: str, fd: int, base: int, size: int) -> None:
    """Listens for readers of the segment (`fd`, mapped at `base` here),
    answered on `watcher`'s thread (which closes the listener when it
    stops). OSError when the socket's name is taken."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(socket_name(engine_address))
        listener.listen(64)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    info = json.dumps({"base": base, "size": size}).encode()

    def reader_went(conn: socket.socket) -> bool:
        with contextlib.suppress(OSError):
            if conn.recv(4096):
                return False            # nothing more is expected: a peer that talks is let be
        return True

    def accept(_: socket.socket) -> bool:
        try:
            conn, _addr = listener.accept()
        except BlockingIOError:
            return False
        except OSError:
            return True
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            if conn.recv(len(HELLO)) != HELLO:
                conn.close()
                return False
            if peer_uid(conn) != os.getuid():
                conn.sendall(json.dumps({"error": "the segment is served to its own user only"}).encode())
                conn.close()
                return False
            socket.send_fds(conn, [info], [fd])
            conn.setblocking(False)
        except OSError:
            conn.close()
            return False
        watcher.watch(conn, reader_went)
        return False

    watcher.watch(listener, accept)


def ask(engine_address: str) -> tuple[socket.socket, int, int, int]:
    """Asks the holder whose engine is at `engine_address` for its segment:
    (the connection, left open; the descriptor; base; size). OSError when
    there is no such server here, PermissionError when it is another
    user's or it refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        sock.connect(socket_name(engine_address))
        if peer_uid(sock) != os.getuid():
            raise PermissionError("the segment's server is another user's process")
        sock.sendall(HELLO)
        msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        try:
            info = json.loads(msg)
        except ValueError:
            raise PermissionError(f"malformed answer {msg[:100]!r}") from None
        if len(fds) != 1 or "base" not in info:
            raise PermissionError(f"refused: {info.get('error', 'no descriptor')}")
        sock.setblocking(False)
        return sock, fds.pop(), int(info["base"]), int(info["size"])
    except BaseException:
        sock.close()
        for fd in fds:
            os.close(fd)
        raise
