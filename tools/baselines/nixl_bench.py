"""NIXL baseline (UCX backend, host memory): one point, two processes.

    python tools/baselines/nixl_bench.py --transport tcp --block-size 65536 \
        --batch 64 --duration 3 --concurrency 2
    python tools/baselines/nixl_bench.py --transport cma ...   # same host

--transport picks UCX's transports through the environment, set before
nixl/UCX load and inherited by the target child:
  tcp: UCX_TLS=tcp (+ UCX_NET_DEVICES=lo) -- data over loopback TCP sockets.
  cma: UCX_TLS=cma,tcp -- the same-host path: puts are CMA zero-copy
       (process_vm_writev by the initiator), TCP only carries UCX's wire-up
       and active messages.  NIXL's default peer-failure handling rules out
       UCX's posix/sysv shared-memory transports anyway, so without RDMA
       tcp + cma is what a default NIXL agent can use on one host.
  sm:  UCX_TLS=sm,self -- UCX shared memory (posix/sysv) + CMA; needs the UCX
       plugin parameter ucx_error_handling_mode=none, set automatically.
  Any other value is passed verbatim as UCX_TLS.
Config (2 shared cores): the initiator has no progress thread and polls
check_xfer_state itself.  The target over tcp runs NIXL's progress thread
(UCX over TCP is not real RDMA: the target must progress to land the data;
that thread busy-polls one core).  Over cma/sm the puts are one-sided CMA, so
the target only polls UCX every 1 ms (--target-progress lazy), which leaves
the CPU to the initiator and measured fastest (or equal) here.
--impl kvflow: the same script on kvflow.compat.nixl (NIXL's API on kvflow):
tcp is kvflow's tcp provider, cma/sm its same-host provider
(process_vm_writev); the UCX settings are not used then.
Per batch the initiator calls make_prepped_xfer on descriptor lists prepared
once (how vLLM's NIXL connector drives it), transfer(), then polls.
--api reuse instead re-posts `concurrency` handles created once (nixlbench's
way; fewer Python calls per batch).
"""
from __future__ import annotations

import argparse
import base64
import os
import sys

import common
import numpy as np

# UCX transports per --transport; with VRAM, UCX stages GPU memory through
# cuda_copy over tcp, and between processes of one host uses cuda_ipc
TLS = {"tcp": "tcp", "cma": "cma,tcp", "sm": "sm,self", "cuda-tcp": "tcp,cuda_copy",
       "cuda-ipc": "cuda_ipc,cuda_copy,sm,self"}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def use_kvflow(transport: str) -> None:
    """`nixl` is kvflow.compat.nixl from now on, here and in the target child."""
    shim = os.path.join(ROOT, "kvflow", "compat", "nixl", "shim", "root")
    for path in (ROOT, shim):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([shim, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ["KVFLOW_NIXL_PROTOCOLS"] = "tcp" if transport == "tcp" else "local"


def load_nixl():
    # nixl-cu12 installs the module as nixl_cu12; the "nixl" meta package
    # (which would pull CUDA/torch) re-exports it as nixl._api.
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def make_agent(name: str, progress_thread: bool):
    nixl_agent, nixl_agent_config = load_nixl()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                               backends=[]))
    params = {}
    if "tcp" not in os.environ.get("UCX_TLS", "tcp"):
        # NIXL asks UCX for peer-failure handling by default, which only the
        # tcp/ib transports offer: with shared-memory transports alone the
        # backend fails ("no active messages transport ... no peer failure
        # handler").  Turning it off is the supported UCX-plugin parameter.
        params["ucx_error_handling_mode"] = "none"
    agent.create_backend("UCX", params)
    return agent


def descs(base: int, offs, block: int) -> np.ndarray:
    """Nx3 (addr, len, device id) array, the cheap form get_xfer_descs takes."""
    d = np.zeros((len(offs), 3), dtype=np.uint64)
    d[:, 0] = base + offs
    d[:, 1] = block
    return d


MEM = {"host": "DRAM", "cuda": "VRAM"}     # NIXL's memory type of each --memory


def target(args) -> None:
    agent = make_agent("target", progress_thread=args.target_progress == "thread")
    offs, region = common.layout(args.block_size, args.batch, args.scatter,
                                 args.max_region)
    buf = common.alloc(region, memory=args.memory)
    agent.register_memory([(common.addr(buf), region, 0, "")], MEM[args.memory])
    common.ready({"meta": base64.b64encode(agent.get_agent_metadata()).decode(),
                  "addr": common.addr(buf)})
    if args.target_progress == "thread":
        common.wait_for_stdin_eof()
    else:
        # Progress UCX from this thread: get_new_notifs() drives the worker.
        # "lazy" sleeps 1 ms between polls, leaving the CPU to the initiator.
        import select
        pause = 0.001 if args.target_progress == "lazy" else 0.0
        while not select.select([sys.stdin], [], [], pause)[0]:
            agent.get_new_notifs()
        sys.stdin.read()
    common.ready({"verified": common.verify(common.host(buf), offs, args.block_size)})


def initiator(args) -> None:
    if args.target_progress == "auto":
        args.target_progress = "lazy" if args.transport in ("cma", "sm") else "thread"
    tls = TLS.get(args.transport, args.transport)
    os.environ["UCX_TLS"] = tls
    if "tcp" in tls:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    peer, info = common.spawn_peer(
        [__file__, "--role", "target", "--block-size", str(args.block_size),
         "--batch", str(args.batch), "--max-region", str(args.max_region),
         "--target-progress", args.target_progress, "--memory", args.memory]
        + (["--scatter"] if args.scatter else []) + ["--impl", args.impl], env=dict(os.environ))
    try:
        agent = make_agent("initiator", progress_thread=False)
        offs, region = common.layout(args.block_size, args.batch, args.scatter,
                                     args.max_region)
        src = common.alloc(region, fill=0xAB, memory=args.memory)
        mem = MEM[args.memory]
        reg = agent.register_memory([(common.addr(src), region, 0, "")], mem)
        remote = agent.add_remote_agent(base64.b64decode(info["meta"]))
        if isinstance(remote, bytes):
            remote = remote.decode()
        local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                           descs(common.addr(src), offs, args.block_size),
                                           mem)
        remote_side = agent.prep_xfer_dlist(remote,
                                            descs(info["addr"], offs, args.block_size),
                                            mem)
        idx = np.arange(args.batch, dtype=np.int32)

        def poll(h):
            while True:
                st = agent.check_xfer_state(h)
                if st == "DONE":
                    return
                if st == "ERR":
                    raise RuntimeError("NIXL transfer failed")

        if args.api == "prepped":
            def submit():
                h = agent.make_prepped_xfer("WRITE", local_side, idx, remote_side, idx)
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("NIXL transfer() failed")
                return h

            def wait(h):
                poll(h)
                agent.release_xfer_handle(h)
        else:
            handles = [agent.make_prepped_xfer("WRITE", local_side, idx, remote_side, idx)
                       for _ in range(args.concurrency)]
            nxt = [0]

            def submit():
                h = handles[nxt[0] % len(handles)]
                nxt[0] += 1
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("NIXL transfer() failed")
                return h

            wait = poll
        batches, secs, lats = common.run_window(submit, wait, args.duration,
                                                args.concurrency)
        # Tear down in order (handles, lists, peer, memory): left to the
        # interpreter's exit, nixl-cu12 1.5.1 segfaults in its destructors.
        for h in (handles if args.api == "reuse" else []):
            agent.release_xfer_handle(h)
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
        entries = batches * args.batch
        proto = ("kvflow-" if args.impl == "kvflow" else "ucx-") + args.transport
        res = common.result("nixl-compat" if args.impl == "kvflow" else "nixl", proto, args,
                            entries * args.block_size, secs, lats, entries)
        res.update(api=args.api, concurrency=args.concurrency, scatter=args.scatter, memory=args.memory,
                   ucx_tls=tls, target_progress=args.target_progress)
        common.emit(common.finish_peer(peer, res))
        peer = None
    finally:
        if peer is not None:
            common.stop_peer(peer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_point_args(p)
    p.add_argument("--transport", default="tcp",
                   help="tcp | cma | sm | cuda-tcp | cuda-ipc | a raw UCX_TLS value")
    p.add_argument("--api", default="prepped", choices=["prepped", "reuse"])
    p.add_argument("--target-progress", default="auto",
                   choices=["auto", "thread", "poll", "lazy"],
                   help="how the target progresses UCX: NIXL's progress thread, "
                   "a busy poll loop, or a poll every 1 ms (auto: lazy for cma "
                   "and sm, else thread)")
    p.add_argument("--role", default="initiator", choices=["initiator", "target"])
    p.add_argument("--impl", default="nixl", choices=["nixl", "kvflow"],
                   help="nixl: NIXL itself; kvflow: kvflow.compat.nixl")
    args = p.parse_args()
    if args.impl == "kvflow":
        use_kvflow(args.transport)
    (target if args.role == "target" else initiator)(args)
    # Even after the explicit teardown, nixl-cu12 1.5.1 still sometimes
    # segfaults (SIGSEGV, exit -11) while the interpreter destroys the agent
    # at exit, after the result was printed and verified.  Skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
