"""SGLang HiCache storage backends, pages set and got per second, in one run.

    python tools/hicache_bench.py                      # the three systems below, 2 page sizes
    python tools/hicache_bench.py --repeat 3 --json out.json

Systems (each: its master, a holder process that mounts a segment, and a
bench process running one SGLang rank's backend that mounts nothing, so
every page crosses tcp on loopback between the two processes):
- kvflow: kvflow's own backend (kvflow.compat.sglang.hicache, SGLang's
  `dynamic` factory, interface_v1) on `python -m kvflow.store master`;
- sglang-mooncake@mooncake: SGLang's Mooncake backend (its file,
  unchanged) on the real Mooncake Store (the mooncake-transfer-engine
  wheel's mooncake_master and mooncake.store);
- sglang-mooncake@kvflow: the same SGLang backend on kvflow's Mooncake API
  (kvflow.compat.mooncake.store through the shim, a kvflow master);
- kvflow@before (with --before DIR): the kvflow system run from another
  checkout (its master, holder, backend and bench role), for a change's
  before and after in the same alternating runs:
      python tools/hicache_bench.py --before /path/to/main --systems kvflow,kvflow@before,sglang-mooncake@mooncake
The bench process is tests/_sglang_hicache.py's `bench` role: SGLang's own
CPU host pool (MHATokenToKVPoolHost, page_first, bf16), per round
batch_set_v1 of --batch new pages (SGLang's backup: an exists call, then
the missing pages) and batch_exists + batch_get_v1 of them (SGLang's
prefetch), every byte compared after the timed calls; median of --rounds
rounds after one warm-up round (systems alternate, their order turning
each repeat); the holder's segment keeps every round's
pages (--remove: removed after each round). Holders: tools/store_bench.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SYSTEMS = ("kvflow", "sglang-mooncake@mooncake", "sglang-mooncake@kvflow")
# (label, tokens per page, layers, heads, head dim): bytes per page = 2 (K, V) x tokens x layers x heads x dim x 2
SHAPES = {"16K": (16, 2, 2, 64), "512K": (64, 4, 4, 128)}


def _env(shim: bool, root: str = ROOT, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_", "KVFLOW_"))}
    paths = [root]
    if shim:
        from kvflow.compat.mooncake import shim_path
        paths.insert(0, shim_path())
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def _free_port() -> int:
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def _run(system: str, shape: str, args) -> dict:
    procs: list[subprocess.Popen] = []
    real = system == "sglang-mooncake@mooncake"
    root = args.before if system == "kvflow@before" else ROOT
    if system == "kvflow@before" and not root:
        raise SystemExit("kvflow@before needs --before DIR")
    try:
        if real:
            port = _free_port()
            procs.append(subprocess.Popen(["mooncake_master", f"--rpc_port={port}", f"--metrics_port={_free_port()}",
                                           "--enable_metric_reporting=false"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            master = f"127.0.0.1:{port}"
            time.sleep(1.0)
        else:
            m = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                                 stdout=subprocess.PIPE, text=True, env=_env(False, root), cwd=root)
            procs.append(m)
            line = m.stdout.readline()
            assert "ready" in line, line
            master = line.split()[-1]
        holder_kind = {"kvflow": "kvflow", "kvflow@before": "kvflow", "sglang-mooncake@mooncake": "mooncake",
                       "sglang-mooncake@kvflow": "kvflow-mc"}[system]
        h = subprocess.Popen([sys.executable, os.path.join(root, "tools", "store_bench.py"), "holder", "--system",
                              holder_kind, "--master", master, "--protocol", "tcp", "--segment", str(args.segment)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=_env(system == "sglang-mooncake@kvflow", root), cwd=root)
        procs.append(h)
        assert h.stdout.readline().strip(), f"{system} holder did not start"
        page, layers, heads, dim = SHAPES[shape]
        a = {"mla": False, "layout": "page_first", "tokens": (2 * args.batch + 4) * page // 2 + page, "page": page,
             "layers": layers, "heads": heads, "dim": dim, "batch": args.batch, "rounds": args.rounds,
             "remove": args.remove}
        if system in ("kvflow", "kvflow@before"):
            a.update(backend="dynamic", extra={"backend_name": "kvflow", "module_path": "kvflow.compat.sglang.hicache",
                                               "class_name": "KVFlowHiCacheStorage", "interface_v1": 1,
                                               "master_server_addr": master, "global_segment_size": 0,
                                               "protocol": "tcp"})
            env = _env(False, root)
        else:
            a.update(backend="mooncake", extra={})
            env = _env(not real, MOONCAKE_MASTER=master, MOONCAKE_PROTOCOL="tcp", MOONCAKE_DEVICE="",
                       MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE", MOONCAKE_GLOBAL_SEGMENT_SIZE="0",
                       MOONCAKE_LOCAL_HOSTNAME="127.0.0.1")
        r = subprocess.run([sys.executable, os.path.join(root, "tests", "_sglang_hicache.py"), "bench",
                            json.dumps(a)], capture_output=True, text=True, env=env, timeout=600, cwd=root)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            return {"system": system, "shape": shape, "error": (r.stdout + r.stderr)[-3000:]}
        return {**json.loads(lines[-1]), "system": system, "shape": shape}
    finally:
        for p in reversed(procs):
            if p.stdin:
                p.stdin.close()
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batch", type=int, default=64, help="pages per call (SGLang's STORAGE_BATCH_SIZE is 128)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1, help="runs per system, alternating")
    p.add_argument("--segment", type=int, default=512 << 20)
    p.add_argument("--json", help="write every run here")
    p.add_argument("--before", help="another checkout (its root folder): adds system kvflow@before, run from it")
    p.add_argument("--remove", action="store_true",
                   help="remove every object after each round (kvflow.store: the next put is then slower)")
    args = p.parse_args(argv)
    runs = []
    systems = args.systems.split(",")
    if args.before and "kvflow@before" not in systems:
        systems.append("kvflow@before")
    args.before = os.path.abspath(args.before) if args.before else None
    for rep in range(args.repeat):
        for shape in args.shapes.split(","):
            # the order turns each repeat (no system always first after a
            # change of shape), and a pause lets the last run's processes go
            for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
                time.sleep(2.0)
                r = _run(system, shape, args)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("set_s", "get_s")}), file=sys.stderr,
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    before = "kvflow@before" in systems
    print("| page | op | " + " | ".join(systems) + " | kvflow / mooncake | kvflow / sglang-mooncake@kvflow |"
          + (" kvflow@before / mooncake |" if before else ""))
    print("|---|---|" + "---|" * (len(systems) + 2 + before))
    for shape in args.shapes.split(","):
        for op in ("set", "get"):
            med = {}
            for system in systems:
                vals = [r[f"{op}_pages_per_s"] for r in runs if r["system"] == system and r["shape"] == shape
                        and "error" not in r]
                med[system] = statistics.median(vals) if vals else None
            cells = [f"{med[s]:.0f}" if med[s] else "error" for s in systems]
            k, mc, mk = med.get("kvflow"), med.get("sglang-mooncake@mooncake"), med.get("sglang-mooncake@kvflow")
            ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"  # noqa: E731
            print(f"| {shape} | {op} pages/s | " + " | ".join(cells) + f" | {ratio(k, mc)} | {ratio(k, mk)} |"
                  + (f" {ratio(med['kvflow@before'], mc)} |" if before else ""))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
