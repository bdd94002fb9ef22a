"""kvflow-bench: throughput and latency of kvflow transfers.

A perf-test CLI in the spirit of Mooncake's ``transfer_engine_bench`` and
``nixlbench``. Three roles:

``target``
    Starts an :class:`kvflow.Engine`, registers one buffer named ``bench``,
    prints ``KVFLOW_TARGET <address>`` on stdout and serves until SIGINT or
    SIGTERM (or until stdin reaches EOF with ``--stdin-control``). It also
    answers checksum requests that ``--verify`` sends as kvflow notifications.
``initiator --target ADDR``
    Connects to a target and runs the load: ``--concurrency`` coroutines, each
    awaiting one batch of ``--batch`` entries of ``--block-size`` bytes at a
    time on its own slice of the local and the remote buffer.
``pair``
    Starts a target in a child process on this machine, runs the initiator
    against it, then stops the target.
``qos``
    Short HIGH batches arriving while a LOW stream saturates the link, in
    FIFO and QoS scheduling in one run (kvflow.cli.bench_qos).
``incast``
    Several senders writing to one receiver at once, with and without a
    receive window (receiver credits), in one run (kvflow.cli.bench_incast).
``store``
    put/get/exists through the KVCache pool (kvflow.store): object sizes,
    batch sizes, client processes, an embedded or a standalone master
    (kvflow.cli.bench_store).

Examples::

    kvflow-bench pair --protocol tcp --block-size 64K --batch 64 --duration 2
    kvflow-bench pair --sweep --block-size 4K,64K,1M,16M --json
    kvflow-bench target --listen 10.0.0.1:7777 --buffer-size 1G
    kvflow-bench initiator --target 10.0.0.1:7777 --listen 10.0.0.2:0 --op read
    kvflow-bench qos --protocol tcp --json
    kvflow-bench incast --senders 3 --windows 0,4M,16M
    kvflow-bench store --size 64K,1M,4M --batch 64 --clients 2 --json

Sizes accept a plain byte count or a binary suffix: ``4K``, ``64KiB``, ``1M``,
``16MiB``, ``1G`` (K, KB and KiB all mean 1024 bytes, as in nixlbench).

Throughput (``gbps``) is in 10**9 bytes per second. Latency percentiles are per
batch, from the call to ``peer.write``/``peer.read`` to its completion.

Exit status: 0 success, 1 error, 2 usage error, 3 verification mismatch,
130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any, Awaitable, Callable, Optional, Sequence

import kvflow
import kvflow.metrics
from kvflow.cli import bench_incast, bench_qos, bench_store
from kvflow.cli.bench_plot import check_plotting, plot_sweep
from kvflow.cli.bench_layout import (
    argparse_type,
    BenchError,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_REGION,
    DEFAULT_SWEEP,
    default_target_buffer_size,
    format_size,
    HostBuffer,
    INITIATOR_PATTERN_TAG,
    Layout,
    MIN_TARGET_BUFFER,
    non_negative_float,
    parse_count_list,
    parse_size,
    parse_size_list,
    positive_float,
    positive_int,
    ranges_digest,
    REGION_NAME,
    SECRET_ENV,
    size_argument,
    TARGET_BANNER,
    TARGET_PATTERN_TAG,
)
from kvflow.cli.bench_load import (
    cancel_all,
    decode_message,
    encode_message,
    measure,
    ReplyRouter,
    Reporter,
    verify_run,
)

__all__ = ["main", "parse_size", "format_size"]


# --------------------------------------------------------------------------
# Engine setup


def _make_engine(args: argparse.Namespace, listen: str) -> kvflow.Engine:
    protocols = None if args.protocol == "auto" else (args.protocol,)
    return kvflow.Engine(
        listen=listen,
        protocols=protocols,
        secret=args.secret or None,          # None: the Engine takes $KVFLOW_SECRET
        tcp_connections=args.tcp_connections,
        **{key: value for key, value in (("slice_size", args.slice_size),
                                         ("rdma_slice_size", args.rdma_slice_size)) if value is not None},
    )


def _log(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(f"kvflow-bench: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Target


async def run_target(args: argparse.Namespace) -> int:
    """Serve one registered buffer until told to stop."""
    layouts = _layouts(args)
    size = args.buffer_size or default_target_buffer_size(layouts)
    buffer = HostBuffer(size)
    # Fills the pages (no first-touch faults during the run) with a pattern an
    # initiator's read can be verified against.
    buffer.fill_pattern(args.seed, TARGET_PATTERN_TAG)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    helpers: list[asyncio.Task[None]] = []
    try:
        async with _make_engine(args, args.listen) as engine:
            region = engine.register(buffer.array, name=REGION_NAME)
            try:
                print(f"{TARGET_BANNER} {engine.address}", flush=True)
                _log(args, f"target serving {format_size(buffer.nbytes)} region {REGION_NAME!r} at {engine.address}")
                helpers.append(loop.create_task(_serve_requests(engine, buffer, args)))
                if args.stdin_control:
                    helpers.append(loop.create_task(_stop_on_stdin_eof(stop)))
                await stop.wait()
                _log(args, "target stopping")
            finally:
                await cancel_all(helpers)
                engine.deregister(region)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0


async def _stop_on_stdin_eof(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
        )
    except (ValueError, OSError):
        # stdin is a regular file: connect_read_pipe refuses those, and
        # reading one to EOF does not block for long.
        await asyncio.to_thread(sys.stdin.buffer.read)
    else:
        try:
            while await reader.read(1 << 16):
                pass
        finally:
            transport.close()
    stop.set()


async def _serve_requests(engine: kvflow.Engine, buffer: HostBuffer, args: argparse.Namespace) -> None:
    memory = memoryview(buffer.array)
    async for sender, data in engine.notifications():
        body = decode_message(data)
        if body is None:
            continue
        reply: dict[str, Any] = {"id": body.get("id"), "op": body.get("op")}
        try:
            if body.get("op") != "checksum":
                raise ValueError(f"unknown request {body.get('op')!r}")
            # hashlib releases the GIL on large updates; the thread keeps the
            # loop (and the engine's completions) running meanwhile.
            reply["digest"] = await asyncio.to_thread(
                ranges_digest, memory,
                body.get("offset"), body.get("stride"), body.get("length"), body.get("count"),
            )
        except ValueError as exc:
            reply["error"] = str(exc)
        _log(args, f"checksum request from {sender}: {reply.get('error', 'ok')}")
        try:
            peer = await engine.connect(sender)
            await peer.notify(encode_message(reply))
        except kvflow.KVFlowError as exc:
            print(f"kvflow-bench: cannot reply to {sender}: {exc}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Initiator and pair


def _layouts(args: argparse.Namespace) -> list[Layout]:
    """One layout per (batch, block size) of the sweep, batches outermost."""
    return [
        Layout(size, batch, args.concurrency, args.scatter, args.max_region)
        for batch in args.batches
        for size in args.block_sizes
    ]


async def run_initiator(args: argparse.Namespace, target: Optional[str] = None) -> int:
    """Connect to the target and run every requested block size."""
    target = target or args.target
    layouts = _layouts(args)
    needed_span = max(layout.span for layout in layouts)
    buffer = HostBuffer(needed_span)
    buffer.fill_pattern(args.seed, INITIATOR_PATTERN_TAG)
    reporter = Reporter(args.json, sys.stdout)
    progress = sys.stderr if (args.progress or (not args.json and not args.no_progress and sys.stderr.isatty())) \
        else None
    needed = kvflow.Access.WRITE if args.op == "write" else kvflow.Access.READ
    mismatches = 0

    async with _make_engine(args, args.listen) as engine:
        region = engine.register(buffer.array, name="bench-initiator")
        router = ReplyRouter(engine)
        router.start()
        try:
            peer = await engine.connect(target, timeout=args.connect_timeout)
            try:
                remote = peer.region(REGION_NAME)
            except KeyError:
                raise BenchError(f"{target} has no region {REGION_NAME!r}; is it a kvflow-bench target?") from None
            if remote.length < needed_span:
                raise BenchError(
                    f"the target's buffer is {format_size(remote.length)}, this run needs "
                    f"{format_size(needed_span)}: start the target with --buffer-size "
                    f"{size_argument(needed_span)} (or the same layout options as this run)"
                )
            if not int(remote.access) & int(needed):
                raise BenchError(f"the target's region does not allow {args.op}")
            if not args.json:
                _log(args, (
                    f"{args.op} to {target} over {peer.transport}: batches of "
                    f"{','.join(map(str, args.batches))} "
                    f"entries, {args.concurrency} in flight, "
                    f"{'scattered' if args.scatter else 'contiguous'} entries"
                ))
            results = []
            for index, layout in enumerate(layouts):
                if args.verify and index:
                    # Fresh contents per run, so a run that moved nothing
                    # cannot pass on what an earlier run left behind.
                    buffer.fill_pattern(args.seed + index, INITIATOR_PATTERN_TAG)
                result = await measure(peer, layout, region.addr, remote.addr, args, progress)
                if args.verify:
                    result.verified = await verify_run(router, peer, buffer, layout, 0, args)
                    mismatches += not result.verified
                reporter.row(result)
                results.append(result)
            if not args.json:
                _log(args, kvflow.metrics.summary(engine, peer.address))
            if args.plot:
                path = plot_sweep(results, args.plot, title=f"kvflow-bench {args.op} over {peer.transport}")
                _log(args, f"wrote {path}")
        finally:
            await router.close()
            engine.deregister(region)
    if mismatches:
        print(f"kvflow-bench: verification FAILED for {mismatches} run(s)", file=sys.stderr, flush=True)
        return 3
    return 0


def _package_parent() -> str:
    # kvflow/cli/bench.py -> the folder holding the kvflow package
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def run_pair(args: argparse.Namespace) -> int:
    """Start a target child process here, run the initiator, stop the target."""
    layouts = _layouts(args)
    buffer_size = args.buffer_size or default_target_buffer_size(layouts)
    command = [
        sys.executable, "-m", "kvflow.cli.bench", "target",
        "--listen", "127.0.0.1:0",
        "--protocol", args.protocol,
        "--tcp-connections", str(args.tcp_connections),
        "--buffer-size", str(buffer_size),
        "--seed", str(args.seed),
        "--stdin-control",
        "--quiet",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_parent(), env.get("PYTHONPATH")]))
    if args.secret:
        # Through the environment, not argv, which any local user can read.
        env[SECRET_ENV] = args.secret
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
    )
    try:
        address = await asyncio.wait_for(_read_banner(process), args.target_start_timeout)
        return await run_initiator(args, address)
    except asyncio.TimeoutError:
        raise BenchError(
            f"the target did not announce its address within {args.target_start_timeout:g} s"
        ) from None
    finally:
        await _stop_target(process)


async def _read_banner(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    while True:
        line = await process.stdout.readline()
        if not line:
            code = await process.wait()
            raise BenchError(f"the target exited with status {code} before announcing its address")
        text = line.decode(errors="replace").strip()
        if text.startswith(TARGET_BANNER + " "):
            return text[len(TARGET_BANNER) + 1 :].strip()
        print(f"kvflow-bench: target: {text}", file=sys.stderr)


async def _stop_target(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None and process.stdin is not None:
        process.stdin.close()  # --stdin-control: EOF asks the target to stop
    for action, grace in ((None, 10.0), (process.terminate, 5.0), (process.kill, None)):
        if process.returncode is not None:
            break
        if action is not None:
            try:
                action()
            except ProcessLookupError:
                break
        try:
            await asyncio.wait_for(process.wait(), grace)
        except asyncio.TimeoutError:
            continue
    if process.returncode not in (0, None):
        print(f"kvflow-bench: the target exited with status {process.returncode}", file=sys.stderr)


# --------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    size = argparse_type(parse_size)
    sizes = argparse_type(parse_size_list)
    count = argparse_type(positive_int)
    counts = argparse_type(parse_count_list)
    seconds = argparse_type(positive_float)
    seconds0 = argparse_type(non_negative_float)

    engine = argparse.ArgumentParser(add_help=False)
    group = engine.add_argument_group("engine")
    group.add_argument("--protocol", choices=("auto", "tcp", "local", "rdma"), default="auto",
                       help="transport to allow (auto: the engine picks; default %(default)s)")
    group.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                       help="this engine's listen address (default %(default)s); an initiator "
                            "on another host must listen where the target can reach it for --verify")
    group.add_argument("--tcp-connections", type=count, default=2, metavar="N",
                       help="TCP connections per peer (default %(default)s)")
    group.add_argument("--slice-size", type=size, default=None, metavar="SIZE",
                       help="tcp/local slice size (default: the engine's, 1 MiB)")
    group.add_argument("--rdma-slice-size", type=size, default=None, metavar="SIZE",
                       help="bytes per rdma work request at most (default: the engine's, 256 KiB)")
    group.add_argument("--secret", default=None, metavar="TEXT",
                       help=f"shared secret for peer authentication (or ${SECRET_ENV})")
    group.add_argument("--seed", type=int, default=1, metavar="N", help="fill-pattern seed (default %(default)s)")

    layout = argparse.ArgumentParser(add_help=False)
    group = layout.add_argument_group("layout")
    group.add_argument("--block-size", type=sizes, default=None, dest="block_sizes", metavar="SIZE[,SIZE...]",
                       help=f"bytes per entry, e.g. 4K, 64KiB, 1M; a list with --sweep "
                            f"(default {DEFAULT_BLOCK_SIZE}, with --sweep {DEFAULT_SWEEP})")
    group.add_argument("--batch", type=counts, default=(32,), dest="batches", metavar="N[,N...]",
                       help="entries per batch (default 32; a list with --sweep)")
    group.add_argument("--concurrency", type=count, default=4, metavar="N",
                       help="batches in flight (default %(default)s)")
    group.add_argument("--scatter", action="store_true",
                       help="leave a block-sized gap after each entry on both sides so the "
                            "engine cannot coalesce entries")
    group.add_argument("--max-region", type=size, default=DEFAULT_MAX_REGION, metavar="SIZE",
                       help="bytes of each buffer the entries may span; beyond it they wrap "
                            f"around (default {format_size(DEFAULT_MAX_REGION)})")
    group.add_argument("--sweep", action="store_true",
                       help="run each size of a --block-size list in one target session")

    target_buffer = argparse.ArgumentParser(add_help=False)
    target_buffer.add_argument("--buffer-size", type=size, default=None, metavar="SIZE",
                               help="target buffer size (default: what the layout needs, at least "
                                    f"{format_size(MIN_TARGET_BUFFER)})")

    load = argparse.ArgumentParser(add_help=False)
    group = load.add_argument_group("load")
    group.add_argument("--op", choices=("write", "read"), default="write",
                       help="write: local -> target; read: target -> local (default %(default)s)")
    stop = group.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=seconds, default=5.0, metavar="SECONDS",
                      help="measured seconds per block size (default %(default)s)")
    stop.add_argument("--total-bytes", type=size, default=None, metavar="SIZE",
                      help="measure until this many bytes moved instead of --duration")
    group.add_argument("--warmup", type=seconds0, default=0.5, metavar="SECONDS",
                       help="unmeasured seconds before each run (default %(default)s)")
    group.add_argument("--verify", action="store_true",
                       help="check after each run that both sides hold the same bytes")
    group.add_argument("--plot", metavar="FILE.png", default=None,
                       help="write throughput and latency against block size (a line per batch) "
                            "to FILE.png (needs matplotlib)")
    group.add_argument("--json", action="store_true",
                       help="print one JSON object per run instead of a table")
    group.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    group.add_argument("--progress", action="store_true",
                       help="progress on stderr even when it is not a terminal (a log): one line per second")
    group.add_argument("--timeout", type=seconds, default=30.0, metavar="SECONDS",
                       help="per-batch timeout in seconds (default %(default)s)")
    group.add_argument("--connect-timeout", type=seconds, default=10.0, help=argparse.SUPPRESS)
    group.add_argument("--verify-timeout", type=seconds, default=120.0, help=argparse.SUPPRESS)

    parser = argparse.ArgumentParser(
        prog="kvflow-bench",
        description="Throughput and latency of kvflow transfers.",
        epilog="Run '%(prog)s ROLE --help' for a role's options.",
    )
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    target = roles.add_parser("target", parents=[engine, layout, target_buffer],
                              help="serve a registered buffer")
    target.add_argument("--stdin-control", action="store_true",
                        help="also stop when stdin reaches EOF")
    target.add_argument("--quiet", action="store_true", help="log nothing to stderr")
    initiator = roles.add_parser("initiator", parents=[engine, layout, load],
                                 help="run the load against a target")
    initiator.add_argument("--target", required=True, metavar="HOST:PORT", help="the target's address (its KVFLOW_TARGET line)")
    pair = roles.add_parser("pair", parents=[engine, layout, target_buffer, load],
                            help="start a local target process and run the load against it")
    pair.add_argument("--target-start-timeout", type=seconds, default=60.0, help=argparse.SUPPRESS)
    bench_qos.add_parser(roles, size, count, seconds)
    bench_incast.add_parser(roles, size, count, seconds)
    bench_store.add_parser(roles, sizes, counts, size, count, seconds)
    return parser


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role in ("qos", "incast"):
        return args
    if args.role == "store":
        bench_store.check_args(parser, args)
        return args
    if args.block_sizes is None:
        default = DEFAULT_SWEEP if args.sweep else DEFAULT_BLOCK_SIZE
        args.block_sizes = parse_size_list(default)
    elif len(args.block_sizes) > 1 and not args.sweep and args.role != "target":
        parser.error("several block sizes need --sweep")
    if len(args.batches) > 1 and not args.sweep and args.role != "target":
        parser.error("several batch sizes need --sweep")
    if getattr(args, "plot", None):
        check_plotting()        # fail before a run, not after it
    return args


_ROLES: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {
    "target": run_target,
    "initiator": run_initiator,
    "pair": run_pair,
    "qos": bench_qos.run_qos,
    "incast": bench_incast.run_incast,
    "store": bench_store.run_store,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kvflow-bench`` and ``python -m kvflow.cli.bench``."""
    args = _parse_args(argv)
    try:
        return asyncio.run(_ROLES[args.role](args))
    except KeyboardInterrupt:
        return 130
    except (BenchError, kvflow.KVFlowError) as exc:
        print(f"kvflow-bench: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
