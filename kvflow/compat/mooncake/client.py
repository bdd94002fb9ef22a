"""python -m kvflow.compat.mooncake.client: `mooncake_client` on kvflow.store,
the standalone real client that Mooncake's dummy clients
(`MooncakeDistributedStore.setup_dummy`, dummy.py) forward every call to.

It holds an ordinary kvflow.store StoreClient (its segment, its engine,
its local buffer) joined to the master at --master_server_address, and
serves dummy clients on the local socket of --port (dummy_wire.py). A
dummy's registered buffers are shared memory it hands over (a memfd):
this process maps the same pages, registers them with its engine, and a
dummy's put_from/get_into addresses are translated into that mapping, so
the bytes move between the pool and the dummy's memory directly. An
address outside what the dummy registered is refused (-600). When a
dummy's last connection closes (it closed, or its process ended), its
mappings go.

Flags: mooncake_client's (Mooncake's real_client_main.cpp), gflags style
(`--flag=value`, `--flag value`, `--bool_flag`, `--nobool_flag`):
    mooncake_client --master_server_address=127.0.0.1:50051 --port=50052 \\
        --global_segment_size="4 GB" --protocol=tcp
It prints `kvflow mooncake_client ready on port P (segment HOST:PORT)` once
dummies can connect, and stops on SIGTERM or SIGINT (status 0). An unknown
flag stops it with status 2 and the list of the flags it takes."""
from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from kvflow.errors import InvalidArgumentError, KVFlowError, ProtocolError
from kvflow.store import StoreClient

from . import shm
from .codes import PROTOCOLS
from .dummy_wire import recv_frame, send_frame, socket_name
from .master import gflags_help, parse_gflags
from .store_setup import engine_thread, size_value, ssd_options
from .waiting import run_blocking

__all__ = ["FLAGS", "RealClient", "main", "parse_client_flags"]

log = logging.getLogger("kvflow.compat.mooncake")

# name -> (kind, default, what kvflow does with it), as master.FLAGS
FLAGS: dict[str, tuple[str, object, str]] = {
    "host": ("str", "0.0.0.0", "the address the client's engine listens on (its segment's host)"),
    "metadata_server": ("str", "http://127.0.0.1:8080/metadata", "taken; kvflow's master records where "
                        "segments listen (as setup()'s metadata_server)"),
    "device_names": ("str", "", "RDMA devices (comma-separated) for --protocol=rdma"),
    "master_server_address": ("str", "127.0.0.1:50051", "the master (host:port, as setup()'s)"),
    "protocol": ("str", "tcp", "tcp or rdma (setup()'s protocols)"),
    "port": ("int", 50052, "the real client's port: dummies reach it at @kvflow_mooncake_client_<port>"),
    "global_segment_size": ("str", "4 GB", "the segment this client gives the pool"),
    "local_buffer_size": ("str", "0", "the client's staging buffer for bytes put/get (at least 16 MB here)"),
    "threads": ("int", 1, "taken; each dummy connection is served on a thread of its own"),
    "tenant_id": ("str", "default", "only 'default': kvflow.store has no tenants"),
    "enable_offload": ("bool", False, "an SSD tier (MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, as setup()'s)"),
    "start_offload_rpc_server": ("bool", True, "taken; no effect"),
    "enable_http_server": ("bool", False, "taken; no client HTTP server is started"),
    "http_port": ("int", 9300, "taken; no effect"),
    "log_dir": ("str", "", "taken; kvflow logs to stderr"),
    "v": ("int", 0, "verbose logging when > 0"),
}
MIN_LOCAL_BUFFER = 16 << 20     # bytes put by dummies are staged here (Mooncake stages them in the dummy's)
_PUT_OPTIONS = frozenset({"replica_num", "pin", "soft_pin", "preferred_segment"})


def parse_client_flags(argv: list[str]) -> dict[str, object]:
    """mooncake_client's command line -> every flag's value (sizes in
    bytes). InvalidArgumentError for an unknown flag or a bad value."""
    values, _ = parse_gflags(argv, FLAGS, "mooncake_client")
    for name in ("global_segment_size", "local_buffer_size"):
        n = size_value(values[name])
        if n is None:
            raise InvalidArgumentError(f"--{name}: {values[name]!r} is not a size")
        values[name] = n
    if values["protocol"] not in PROTOCOLS:
        raise InvalidArgumentError(f"--protocol {values['protocol']!r}: one of {', '.join(PROTOCOLS)}")
    if values["tenant_id"] not in ("", "default"):
        raise InvalidArgumentError(f"--tenant_id {values['tenant_id']!r}: kvflow.store has no tenants")
    if not 0 < int(values["port"]) < 65536:
        raise InvalidArgumentError(f"--port {values['port']}: not a port")
    return values


@dataclass
class Mapping:
    """One buffer of a dummy: where it is there and here."""
    dummy_addr: int
    size: int
    real_addr: int
    fd: int
    region: Any

    def translate(self, addr: int, size: int) -> int | None:
        if self.dummy_addr <= addr and addr + size <= self.dummy_addr + self.size:
            return self.real_addr + (addr - self.dummy_addr)
        return None


@dataclass
class Session:
    """A dummy client (by the id it says hello with): its mappings, and how
    many of its connections are open."""
    id: str
    mappings: dict[int, Mapping] = field(default_factory=dict)
    conns: int = 0

    def translate(self, addr: int, size: int) -> int | None:
        for m in list(self.mappings.values()):
            if (real := m.translate(addr, size)) is not None:
                return real
        return None


class RealClient:
    """The StoreClient and the dummies it serves."""

    def __init__(self, thread: Any, client: StoreClient, hostname: str) -> None:
        self.thread, self.client, self.hostname = thread, client, hostname
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._calls: dict[str, Callable[..., Any]] = {
            "batch_put": self._batch_put, "batch_put_from": self._batch_put_from,
            "batch_put_from_parts": self._batch_put_from_parts, "batch_get_into_parts": self._batch_get_into_parts,
            "batch_get": lambda s, keys: self._run(self.client.batch_get(keys)),
            "batch_exists": self._batch_exists,
            "batch_remove": lambda s, keys, force=False: self._run(self.client.batch_remove(keys, force=bool(force))),
            "size": lambda s, key: self._run(self.client.size(key)),
            "stats": lambda s: self._run(self.client.stats()),
            "remove_all": lambda s, force=False: self._run(self.client.remove_all(force=bool(force))),
            "remove_by_regex": lambda s, pattern, force=False: self._run(
                self.client.remove_by_regex(pattern, force=bool(force))),
            "query_task": lambda s, task_id: self._run(self.client.query_task(tuple(task_id))),
            "replica_desc": lambda s, key: self._run(self.client.replica_desc(key)),
            "create_copy_task": lambda s, key, targets: self._run(self.client.create_copy_task(key, targets)),
            "create_move_task": lambda s, key, src, dst: self._run(self.client.create_move_task(key, src, dst)),
            "map": self._map, "unmap": self._unmap,
        }

    def _run(self, coro: Any) -> Any:
        return run_blocking(self.thread, coro)

    def _batch_exists(self, s: Session, keys: list) -> list:
        # straight to the master from this thread when the client can (no
        # hop to its loop), as a store of its own answers is_exist
        found = self.client.batch_exists_blocking(keys)
        return found if found is not None else self._run(self.client.batch_exists(keys))

    # ------------------------------------------------------------ memory
    def _map(self, s: Session, dummy_addr: int, size: int, *, fds: list[int]) -> int:
        if len(fds) != 1:
            raise InvalidArgumentError("map needs the shared memory's descriptor")
        fd = fds.pop()
        try:
            if dummy_addr in s.mappings:
                raise InvalidArgumentError(f"{dummy_addr:#x} is registered already")
            real = shm.map_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        try:
            region = self.thread.call_sync(self.client.register_buffer, (real, size))
        except BaseException:
            shm.unmap(real, size)
            os.close(fd)
            raise
        s.mappings[dummy_addr] = Mapping(dummy_addr, size, real, fd, region)
        return 0

    def _unmap(self, s: Session, dummy_addr: int) -> int:
        m = s.mappings.pop(dummy_addr, None)
        if m is None:
            raise InvalidArgumentError(f"{dummy_addr:#x} is not a registered buffer")
        self._drop(m)
        return 0

    def _drop(self, m: Mapping) -> None:
        try:
            self.thread.call_sync(self.client.unregister_buffer, m.region)
        finally:
            shm.unmap(m.real_addr, m.size)
            os.close(m.fd)

    # ------------------------------------------------------------ calls with addresses
    @staticmethod
    def _outside(addr: int, size: int) -> InvalidArgumentError:
        return InvalidArgumentError(f"{addr:#x}+{size} is not in a buffer this dummy registered")

    def _subset(self, n: int, bad: dict[int, BaseException], run: Callable[[list[int]], list]) -> list:
        """Runs the items not in `bad` as one batch; the results in order."""
        good = [i for i in range(n) if i not in bad]
        got = iter(run(good) if good else [])
        return [bad[i] if i in bad else next(got) for i in range(n)]

    def _parts(self, s: Session, parts: list) -> tuple[list, dict[int, BaseException]]:
        real, bad = [], {}
        for i, ps in enumerate(parts):
            row = []
            for addr, size in ps:
                r = s.translate(int(addr), int(size))
                if r is None:
                    bad[i] = self._outside(int(addr), int(size))
                    break
                row.append((r, int(size)))
            real.append(row)
        return real, bad

    @staticmethod
    def _put_kw(kw: dict) -> dict:
        if unknown := set(kw) - _PUT_OPTIONS:
            raise InvalidArgumentError(f"unknown put options {sorted(unknown)}")
        return kw

    def _batch_put(self, s: Session, keys: list, values: list, **kw: Any) -> list:
        return self._run(self.client.batch_put(keys, values, **self._put_kw(kw)))

    def _batch_put_from(self, s: Session, keys: list, addrs: list, sizes: list, **kw: Any) -> list:
        if not len(keys) == len(addrs) == len(sizes):
            raise InvalidArgumentError("keys, addrs and sizes must have the same length")
        return self._batch_put_from_parts(s, keys, [[(a, n)] for a, n in zip(addrs, sizes)], **kw)

    def _batch_put_from_parts(self, s: Session, keys: list, parts: list, **kw: Any) -> list:
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        real, bad = self._parts(s, parts)
        kw = self._put_kw(kw)
        return self._subset(len(keys), bad, lambda idx: self._run(self.client.batch_put_from_parts(
            [keys[i] for i in idx], [real[i] for i in idx], **kw)))

    def _batch_get_into_parts(self, s: Session, keys: list, parts: list) -> list:
        if len(keys) != len(parts):
            raise InvalidArgumentError("keys and parts must have the same length")
        real, bad = self._parts(s, parts)
        return self._subset(len(keys), bad, lambda idx: self._run(self.client.batch_get_into_parts(
            [keys[i] for i in idx], [real[i] for i in idx])))

    # ------------------------------------------------------------ connections
    def serve(self, listener: socket.socket) -> None:
        """Accepts dummies until the listener is closed."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_conn, args=(conn,), name="kvflow-mooncake-dummy-conn",
                             daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        session: Session | None = None
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                log.warning("kvflow mooncake_client: refused a connection of uid %d", uid)
                return
            while True:
                try:
                    (method, args, kw), fds = recv_frame(conn)
                except (EOFError, OSError):
                    return
                except (ValueError, TypeError, ProtocolError) as e:
                    log.warning("kvflow mooncake_client: a malformed request: %s", e)
                    return
                try:
                    if session is None:
                        session = self._hello(method, args)
                        result: Any = {"hostname": self.hostname}
                    else:
                        result = self._dispatch(session, method, args, kw, fds)
                    reply = [0, result]
                except KVFlowError as e:
                    reply = [1, e]
                except (TypeError, ValueError) as e:        # arguments of the wrong shape
                    reply = [1, InvalidArgumentError(f"{method}: {e}")]
                finally:
                    for fd in fds:
                        os.close(fd)
                send_frame(conn, reply)
        except OSError:
            return
        finally:
            conn.close()
            if session is not None:
                self._bye(session)

    def _hello(self, method: str, args: list) -> Session:
        if method != "hello" or len(args) != 1 or not isinstance(args[0], str):
            raise ProtocolError("a dummy says hello first")
        with self._lock:
            s = self.sessions.setdefault(args[0], Session(args[0]))
            s.conns += 1
        return s

    def _bye(self, s: Session) -> None:
        """A connection closed: with the dummy's last, its mappings go."""
        with self._lock:
            s.conns -= 1
            if s.conns:
                return
            del self.sessions[s.id]
        for m in list(s.mappings.values()):
            try:
                self._drop(m)
            except KVFlowError as e:
                log.warning("kvflow mooncake_client: dropping a dummy's buffer: %s", e)
        s.mappings.clear()

    def _dispatch(self, s: Session, method: str, args: list, kw: dict, fds: list[int]) -> Any:
        fn = self._calls.get(method)
        if fn is None:
            raise InvalidArgumentError(f"unknown call {method!r}")
        if method == "map":
            return fn(s, *args, fds=fds)
        return fn(s, *args, **kw)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if usage := gflags_help(argv, "mooncake_client", "kvflow's standalone real client for Mooncake dummy "
                            "clients, with mooncake_client's flags", FLAGS):
        print(usage)
        return 0
    try:
        v = parse_client_flags(argv)
    except InvalidArgumentError as e:
        print(f"mooncake_client (kvflow): {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if int(v["v"]) > 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if v["enable_http_server"]:
        log.warning("kvflow mooncake_client: --enable_http_server: no client HTTP server is started")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(socket_name(int(v["port"])))
    except OSError as e:
        print(f"mooncake_client (kvflow): port {v['port']}: {e} (another real client has it)", file=sys.stderr)
        return 1
    listener.listen(128)
    try:
        ssd = ssd_options("") if v["enable_offload"] else {}
        thread, _, hostname = engine_thread(None, str(v["host"]), "", str(v["protocol"]), str(v["device_names"]))
        if str(v["host"]) in ("0.0.0.0", "::"):
            hostname = thread.engine.address        # the segment by the name its engine advertises
    except KVFlowError as e:
        print(f"mooncake_client (kvflow): {e}", file=sys.stderr)
        return 1
    master: str | list[str] = str(v["master_server_address"])
    if "," in master and "://" not in master:
        master = [a.strip() for a in master.split(",") if a.strip()]
    try:
        client = StoreClient(master, engine=thread.engine, segment_size=int(v["global_segment_size"]),
                             local_buffer_size=max(int(v["local_buffer_size"]), MIN_LOCAL_BUFFER),
                             segment_name=hostname, **ssd)
        thread.call(client.start())
    except Exception as e:  # noqa: BLE001 - reported, then the exit status
        print(f"mooncake_client (kvflow): cannot join the pool at {v['master_server_address']}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        thread.close()
        return 1
    real = RealClient(thread, client, hostname)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=real.serve, args=(listener,), name="kvflow-mooncake-client-accept", daemon=True).start()
    print(f"kvflow mooncake_client ready on port {v['port']} (segment {hostname}, master "
          f"{v['master_server_address']})", flush=True)
    while not stop.wait(1.0):
        pass
    try:
        listener.shutdown(socket.SHUT_RDWR)      # wakes the accepting thread
    except OSError:
        pass
    listener.close()
    try:
        thread.call(client.close(), timeout=30)
    except Exception as e:  # noqa: BLE001 - leaving goes on
        log.warning("kvflow mooncake_client: close: %s", e)
    thread.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
