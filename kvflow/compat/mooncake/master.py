"""python -m kvflow.compat.mooncake.master: `mooncake_master` on kvflow.store.

Takes mooncake_master's gflags-style flags (`--flag=value`, `--flag value`,
a bare `--bool_flag`, `--nobool_flag`) and runs kvflow's store master
(`python -m kvflow.store master`) with their meanings, so Mooncake's CI
scripts and tests start it unchanged (`python -m kvflow.compat.mooncake.shim
--bin` prints a directory with a `mooncake_master` executable for PATH):

    mooncake_master --default_kv_lease_ttl=500 --eviction_high_watermark_ratio=0.95 \\
        --cluster_id=ci_test_cluster --port 50051 --enable_http_metadata_server=true

With --enable_http_metadata_server it also serves Mooncake's HTTP metadata
protocol (http_metadata.py) on --http_metadata_server_host:port, before the
master's `ready` line. A flag kvflow does not know stops it with status 2
and the list of the flags it takes; the flags in IGNORED are taken and have
no effect here (each says why in FLAGS' help)."""
from __future__ import annotations

import asyncio
import re
import sys
import threading
from dataclasses import dataclass

from kvflow.errors import InvalidArgumentError

__all__ = ["FLAGS", "MasterOptions", "parse_flags", "gflags_help", "parse_gflags", "store_argv", "main"]

# name -> (kind, default, what kvflow does with it). kind: "int", "float",
# "str", "bool", "ms" (Mooncake's duration: a number of milliseconds or
# 500ms / 5s / 1m / 1h).
FLAGS: dict[str, tuple[str, object, str]] = {
    "port": ("int", 50051, "the master's port (mooncake_master's deprecated name of --rpc_port)"),
    "rpc_port": ("int", 0, "the master's port; 0: --port"),
    "rpc_address": ("str", "0.0.0.0", "the address the master listens on"),
    "default_kv_lease_ttl": ("ms", 5000, "a get's lease (kvflow's --lease-ttl)"),
    "eviction_high_watermark_ratio": ("float", 0.90, "eviction starts above this fill (--high-watermark)"),
    "eviction_ratio": ("float", 0.05, "the share of capacity one eviction frees (--low-watermark = high - ratio)"),
    "cluster_id": ("str", "mooncake_cluster", "the cluster's name in etcd (--cluster)"),
    "enable_ha": ("bool", False, "a durable master in etcd (--etcd): needs --etcd_endpoints"),
    "etcd_endpoints": ("str", "", "etcd, host:port[;host:port...]: kvflow takes the first (--etcd)"),
    "client_ttl": ("int", 0, "seconds of silence before a client is lost (--client-grace; 0: kvflow's 60 s)"),
    "enable_http_metadata_server": ("bool", False, "serve Mooncake's HTTP metadata protocol as well"),
    "http_metadata_server_port": ("int", 8080, "its port"),
    "http_metadata_server_host": ("str", "0.0.0.0", "its address"),
    "root_fs_dir": ("str", "", "where the Mooncake API's clients keep SSD tiers, <dir>/<cluster_id>/... "
                    "(--root-fs-dir)"),
    "metrics_port": ("int", 9003, "Prometheus metrics on this port (--metrics-port), when given"),
    "enable_metric_reporting": ("bool", True, "false: no metrics port even when --metrics_port is given"),
    "metrics_host": ("str", "0.0.0.0", "taken; no effect"),
    "rpc_thread_num": ("int", 0, "taken; kvflow's master is one event loop"),
    "max_threads": ("int", 16, "taken; kvflow's master is one event loop"),
    "rpc_enable_tcp_no_delay": ("bool", True, "taken; kvflow always sets TCP_NODELAY"),
    "rpc_conn_timeout_seconds": ("int", 0, "taken; no effect"),
    "memory_allocator": ("str", "offset", "taken; kvflow has one allocator"),
    "v": ("int", 0, "verbose logging when > 0"),
}
IGNORED = frozenset({"metrics_host", "rpc_thread_num", "max_threads", "rpc_enable_tcp_no_delay",
                     "rpc_conn_timeout_seconds", "memory_allocator"})
_TRUE = ("true", "1", "yes", "t", "y")
_FALSE = ("false", "0", "no", "f", "n")


@dataclass
class MasterOptions:
    """The flags, as kvflow's master takes them (seconds, not ms)."""
    listen: str = "0.0.0.0:50051"
    lease_ttl: float = 5.0
    high_watermark: float = 0.90
    low_watermark: float = 0.85
    cluster: str = "mooncake_cluster"
    etcd: str | None = None
    client_grace: float | None = None
    http_metadata: tuple[str, int] | None = None     # (host, port) when served
    root_fs_dir: str = ""
    metrics_port: int | None = None                   # only when --metrics_port is given
    verbose: bool = False


def _duration_ms(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (500, 500ms, 5s, 1m, 1h)")
    return float(m.group(1)) * {None: 1, "ms": 1, "s": 1e3, "m": 60e3, "h": 3600e3}[m.group(2)]


def _value(name: str, text: str, flags: dict[str, tuple[str, object, str]]) -> object:
    kind = flags[name][0]
    try:
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"{text!r} is not a boolean")
        if kind == "ms":
            return _duration_ms(text)
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError as e:
        raise InvalidArgumentError(f"--{name}: {e}") from None


def _unknown(flag: str, flags: dict[str, tuple[str, object, str]], prog: str) -> InvalidArgumentError:
    taken = ", ".join(f"--{n}" for n in flags)
    return InvalidArgumentError(f"unknown flag {flag!r}: kvflow's {prog} takes {taken} "
                                "(both --flag=value and --flag value; see --help)")


def parse_flags(argv: list[str]) -> tuple[MasterOptions, dict[str, object]]:
    """mooncake_master's command line -> (kvflow's options, every flag's
    value). Raises InvalidArgumentError for an unknown flag, a missing or
    bad value, or a combination kvflow cannot serve."""
    values, given = parse_gflags(argv, FLAGS, "mooncake_master")
    return _options(values, given), values


def parse_gflags(argv: list[str], flags: dict[str, tuple[str, object, str]],
                 prog: str) -> tuple[dict[str, object], set[str]]:
    """A Mooncake program's gflags command line against its table `flags`
    (name -> (kind, default, help)): (every flag's value, the names given).
    Raises InvalidArgumentError for an unknown flag or a missing or bad value."""
    values = {name: default for name, (_, default, _) in flags.items()}
    given: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise InvalidArgumentError(f"unexpected argument {arg!r}: {prog} takes flags only")
        name, eq, text = arg.lstrip("-").partition("=")
        if name not in flags and name.startswith("no") and flags.get(name[2:], ("",))[0] == "bool" and not eq:
            values[name[2:]] = False
            given.add(name[2:])
            continue
        if name not in flags:
            raise _unknown(arg, flags, prog)
        given.add(name)
        if not eq:
            if flags[name][0] == "bool":          # gflags: a bare bool flag is true, never takes the next word
                values[name] = True
                continue
            if i >= len(argv):
                raise InvalidArgumentError(f"--{name} needs a value")
            text = argv[i]
            i += 1
        values[name] = _value(name, text, flags)
    return values, given


def _options(v: dict[str, object], given: set[str]) -> MasterOptions:
    port = int(v["rpc_port"]) or int(v["port"])
    high, ratio = float(v["eviction_high_watermark_ratio"]), float(v["eviction_ratio"])
    if not 0 < high <= 1 or not 0 <= ratio <= 1:
        raise InvalidArgumentError("--eviction_high_watermark_ratio must be in (0, 1], --eviction_ratio in [0, 1]")
    etcd = None
    if v["enable_ha"]:
        endpoints = [e.strip() for e in re.split(r"[;,]", str(v["etcd_endpoints"])) if e.strip()]
        if not endpoints:
            raise InvalidArgumentError("--enable_ha needs --etcd_endpoints")
        etcd = endpoints[0].removeprefix("http://")
    http = None
    if v["enable_http_metadata_server"]:
        http = (str(v["http_metadata_server_host"]), int(v["http_metadata_server_port"]))
    return MasterOptions(listen=f"{v['rpc_address']}:{port}", lease_ttl=float(v["default_kv_lease_ttl"]) / 1000,
                         high_watermark=high, low_watermark=max(0.0, high - ratio), cluster=str(v["cluster_id"]),
                         etcd=etcd, client_grace=float(v["client_ttl"]) or None, http_metadata=http,
                         root_fs_dir=str(v["root_fs_dir"]), verbose=int(v["v"]) > 0,
                         metrics_port=int(v["metrics_port"]) if "metrics_port" in given and v["enable_metric_reporting"]
                         else None)


def store_argv(opts: MasterOptions) -> list[str]:
    """The same master as `python -m kvflow.store master` arguments."""
    argv = ["master", "--listen", opts.listen, "--lease-ttl", repr(opts.lease_ttl),
            "--high-watermark", repr(opts.high_watermark), "--low-watermark", repr(opts.low_watermark)]
    if opts.client_grace is not None:
        argv += ["--client-grace", repr(opts.client_grace)]
    argv += ["--cluster", opts.cluster]         # etcd's namespace, and root_fs_dir's subdirectory
    if opts.etcd is not None:
        argv += ["--etcd", opts.etcd]
    if opts.root_fs_dir:
        argv += ["--root-fs-dir", opts.root_fs_dir]
    if opts.metrics_port is not None:
        argv += ["--metrics-port", str(opts.metrics_port)]
    if opts.verbose:
        argv.append("-v")
    return argv


def _serve_metadata(host: str, port: int) -> tuple[int, threading.Thread]:
    """Mooncake's HTTP metadata server on a daemon thread of its own (as
    mooncake_master runs it beside the master): the port it listens on.
    Raises OSError when the address is taken."""
    from .http_metadata import HttpMetadataServer

    bound: list[object] = []
    ready = threading.Event()

    def run() -> None:
        async def serve() -> None:
            server = HttpMetadataServer(host, port)
            try:
                await server.start()
            except OSError as e:
                bound.append(e)
                ready.set()
                return
            bound.append(server.port)
            ready.set()
            await asyncio.Event().wait()        # until the process exits
        asyncio.run(serve())

    thread = threading.Thread(target=run, name="kvflow-mooncake-http-metadata", daemon=True)
    thread.start()
    ready.wait()
    if isinstance(bound[0], OSError):
        raise bound[0]
    return int(bound[0]), thread


def gflags_help(argv: list[str], prog: str, what: str, flags: dict[str, tuple[str, object, str]]) -> str | None:
    """The usage text when argv asks for help (-h, --help, ...), else None."""
    if not any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
        return None
    lines = [f"usage: {prog} [--flag=value | --flag value | --bool_flag | --nobool_flag] ...", f"{what}:"]
    lines += [f"  --{n} ({k}, default {d!r}): {h}" for n, (k, d, h) in flags.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if usage := gflags_help(argv, "mooncake_master", "kvflow's store master with mooncake_master's flags", FLAGS):
        print(usage)
        return 0
    try:
        opts, _ = parse_flags(argv)
    except InvalidArgumentError as e:
        print(f"mooncake_master (kvflow): {e}", file=sys.stderr)
        return 2
    if opts.http_metadata is not None:
        try:
            port, _ = _serve_metadata(*opts.http_metadata)
        except OSError as e:
            print(f"mooncake_master (kvflow): HTTP metadata server on {opts.http_metadata[0]}:"
                  f"{opts.http_metadata[1]}: {e}", file=sys.stderr)
            return 1
        print(f"kvflow mooncake_master: HTTP metadata server on http://{opts.http_metadata[0]}:{port}/metadata",
              flush=True)
    from kvflow.store.__main__ import main as store_main
    return store_main(store_argv(opts))


if __name__ == "__main__":
    sys.exit(main())
