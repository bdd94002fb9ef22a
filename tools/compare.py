"""Run the same benchmark points through kvflow and other engines; print one table.

    python tools/compare.py                      # everything, 3 s per point
    python tools/compare.py --duration 1 --sizes 4K,1M --only kvflow,ceilings
    python tools/compare.py --repeat 3 --markdown --json results.json --plot results.png
    python tools/compare.py --from-json results.json --plot results.png   # no new runs

Every measurement runs in its own subprocess(es) and prints one JSON object
(engine, protocol, op, block_size, batch, bytes, seconds, gbps, latency_p50_us,
latency_p99_us, entries_per_s):
  kvflow    python -m kvflow.cli.bench pair ... --json   (the project's own CLI)
  mooncake  tools/baselines/mooncake_bench.py       (Mooncake TE, tcp)
  mooncake-compat  mooncake_bench.py --impl kvflow   (the same script on
            kvflow.compat.mooncake: Mooncake's API backed by kvflow)
  nixl      tools/baselines/nixl_bench.py           (NIXL, UCX tcp / cma)
  ceilings  tools/baselines/ceilings.py             (socket, process_vm_writev, memcpy)
  store     tools/store_bench.py's run_system: kvflow.store and Mooncake Store
            (mooncake_master + mooncake.store), each a master, a holder and a
            bench client process over tcp, every get's bytes compared
See tools/baselines/README.md for what each row measures and how to install.

Groups (rows that are compared with each other):
  tcp        write, batch 64, per block size: kvflow tcp, Mooncake tcp,
             kvflow's Mooncake-compatible API (mooncake-compat), NIXL UCX-tcp;
             ceiling: raw Python sockets (2 connections).
  local      write, batch 64, per block size: kvflow local, NIXL UCX-cma and
             UCX-sm (two same-host UCX configs; the better one counts);
             ceilings: process_vm_writev, memcpy.
  lat-tcp /  one 4 KiB write at a time (batch 1, concurrency 1), p50 latency:
  lat-local  kvflow tcp vs Mooncake / NIXL tcp; kvflow local vs NIXL cma/sm.
  scatter    4 KiB entries at non-adjacent addresses, batch 64, several
             batches in flight, same host: kvflow local --scatter vs NIXL.
  store      the KVCache pool, issue 40's layout: batch_put_from and
             batch_get_into of --batch objects of --store-sizes (64K,1M,4M)
             into another process's segment over tcp, median of
             --store-rounds calls: kvflow.store vs Mooncake Store; ceiling:
             kvflow's own tcp write/read of the same entries (kvflow-raw),
             then memcpy.
  store-exists  batch_exists of 128 keys that exist, p50 of 200 calls
             (Mooncake: batch_is_exist).
The "kvflow / best alt" column divides kvflow's metric by the best other
engine's (ceilings and mooncake-compat excluded: that is kvflow too); on a
mooncake-compat row it divides by Mooncake's, same calls, same point: >1 is
better for GB/s and entries/s, <1 is better for latency.  "of ceiling" divides by the group's first ceiling.
An engine whose Python package is missing is shown as "not installed"; a run
that fails or times out is shown as "error" (its message is in --json).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tools", "baselines")
ENGINES = ("kvflow", "mooncake", "mooncake-compat", "nixl", "nixl-compat", "ceilings")
# kvflow behind another engine's API: compared with that engine, not an alternative to kvflow
COMPAT = {"mooncake-compat": "mooncake", "nixl-compat": "nixl"}
CEILINGS = {"socket", "process_vm_writev", "memcpy", "kvflow-raw"}

# metric per group, and whether higher is better
METRIC = {"tcp": ("gbps", True), "local": ("gbps", True),
          "lat-tcp": ("latency_p50_us", False), "lat-local": ("latency_p50_us", False),
          "scatter": ("entries_per_s", True), "store": ("gbps", True),
          "store-exists": ("latency_p50_us", False)}
TITLE = {"tcp": "write b64 over TCP (GB/s)", "local": "write b64 same host (GB/s)",
         "lat-tcp": "one 4 KiB write, TCP (p50 us)",
         "lat-local": "one 4 KiB write, same host (p50 us)",
         "scatter": "scattered 4 KiB entries, same host (entries/s)",
         "store": "KVCache pool: 64 objects per batch call, TCP (GB/s)",
         "store-exists": "KVCache pool: batch_exists of 128 keys (p50 us)"}
STORE_GROUPS = ("store", "store-exists")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def installed(engine: str) -> bool:
    """Is the engine's Python package present at all?  (If it is present but
    fails to load, the run itself reports the error.)"""
    if engine == "kvflow":
        return True  # the project itself: a failure is an "error" row
    if engine == "mooncake":
        return importlib.util.find_spec("mooncake") is not None
    if engine == "nixl":
        return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))
    return True


# --------------------------------------------------------------------------- points
def point_args(bs: int, batch: int, duration: float, conc: int, scatter: bool) -> list[str]:
    a = ["--op", "write", "--block-size", str(bs), "--batch", str(batch),
         "--duration", str(duration), "--concurrency", str(conc)]
    return a + (["--scatter"] if scatter else [])


def kvflow_cmd(protocol: str, pa: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvflow.cli.bench", "pair", "--protocol", protocol] + pa + \
           ["--json", "--no-progress"]


def base_cmd(script: str, pa: list[str], *extra: str) -> list[str]:
    return [sys.executable, os.path.join(BASE, script)] + list(extra) + pa


def plan(args) -> list[dict]:
    """All (group, point, engine) measurements, in run order."""
    out = []

    def add(group, label, family, engine, protocol, cmd):
        out.append({"group": group, "point": label, "family": family, "engine": engine,
                    "protocol": protocol, "cmd": cmd})

    d, c = args.duration, args.concurrency
    for bs in args.sizes:
        pa = point_args(bs, args.batch, d, c, False)
        label = fmt_size(bs)
        add("tcp", label, "kvflow", "kvflow", "tcp", kvflow_cmd("tcp", pa))
        add("tcp", label, "mooncake", "mooncake", "tcp", base_cmd("mooncake_bench.py", pa))
        add("tcp", label, "mooncake-compat", "mooncake-compat", "tcp",
            base_cmd("mooncake_bench.py", pa, "--impl", "kvflow"))
        add("tcp", label, "nixl", "nixl", "ucx-tcp", base_cmd("nixl_bench.py", pa, "--transport", "tcp"))
        add("tcp", label, "nixl-compat", "nixl-compat", "kvflow-tcp",
            base_cmd("nixl_bench.py", pa, "--transport", "tcp", "--impl", "kvflow"))
        add("tcp", label, "ceilings", "socket", "tcp", base_cmd("ceilings.py", pa, "--kind", "socket"))
    for bs in args.sizes:
        pa = point_args(bs, args.batch, d, c, False)
        label = fmt_size(bs)
        add("local", label, "kvflow", "kvflow", "local", kvflow_cmd("local", pa))
        add("local", label, "nixl", "nixl", "ucx-cma", base_cmd("nixl_bench.py", pa, "--transport", "cma"))
        add("local", label, "nixl", "nixl", "ucx-sm", base_cmd("nixl_bench.py", pa, "--transport", "sm"))
        add("local", label, "nixl-compat", "nixl-compat", "kvflow-cma",
            base_cmd("nixl_bench.py", pa, "--transport", "cma", "--impl", "kvflow"))
        add("local", label, "ceilings", "process_vm_writev", "local", base_cmd("ceilings.py", pa, "--kind", "pvm"))
        add("local", label, "ceilings", "memcpy", "local", base_cmd("ceilings.py", pa, "--kind", "memcpy"))
    pa = point_args(4096, 1, d, 1, False)
    add("lat-tcp", "4 KiB x1", "kvflow", "kvflow", "tcp", kvflow_cmd("tcp", pa))
    add("lat-tcp", "4 KiB x1", "mooncake", "mooncake", "tcp", base_cmd("mooncake_bench.py", pa))
    add("lat-tcp", "4 KiB x1", "mooncake-compat", "mooncake-compat", "tcp",
        base_cmd("mooncake_bench.py", pa, "--impl", "kvflow"))
    add("lat-tcp", "4 KiB x1", "nixl", "nixl", "ucx-tcp", base_cmd("nixl_bench.py", pa, "--transport", "tcp"))
    add("lat-tcp", "4 KiB x1", "nixl-compat", "nixl-compat", "kvflow-tcp",
        base_cmd("nixl_bench.py", pa, "--transport", "tcp", "--impl", "kvflow"))
    add("lat-tcp", "4 KiB x1", "ceilings", "socket", "tcp", base_cmd("ceilings.py", pa, "--kind", "socket"))
    add("lat-local", "4 KiB x1", "kvflow", "kvflow", "local", kvflow_cmd("local", pa))
    add("lat-local", "4 KiB x1", "nixl", "nixl", "ucx-cma", base_cmd("nixl_bench.py", pa, "--transport", "cma"))
    add("lat-local", "4 KiB x1", "nixl", "nixl", "ucx-sm", base_cmd("nixl_bench.py", pa, "--transport", "sm"))
    add("lat-local", "4 KiB x1", "nixl-compat", "nixl-compat", "kvflow-cma",
        base_cmd("nixl_bench.py", pa, "--transport", "cma", "--impl", "kvflow"))
    add("lat-local", "4 KiB x1", "ceilings", "process_vm_writev", "local", base_cmd("ceilings.py", pa, "--kind", "pvm"))
    pa = point_args(4096, args.batch, d, args.scatter_concurrency, True)
    label = f"4 KiB b{args.batch} c{args.scatter_concurrency}"
    add("scatter", label, "kvflow", "kvflow", "local", kvflow_cmd("local", pa))
    add("scatter", label, "nixl", "nixl", "ucx-cma", base_cmd("nixl_bench.py", pa, "--transport", "cma"))
    add("scatter", label, "nixl", "nixl", "ucx-sm", base_cmd("nixl_bench.py", pa, "--transport", "sm"))
    add("scatter", label, "ceilings", "process_vm_writev", "local", base_cmd("ceilings.py", pa, "--kind", "pvm"))
    return [p for p in out if p["family"] in args.only]


# --------------------------------------------------------------------------- running
def run_once(p: dict, timeout: float) -> dict:
    try:
        cp = subprocess.run(p["cmd"], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
    if cp.returncode != 0 or not lines:
        tail = [ln for ln in (cp.stderr or cp.stdout).strip().splitlines() if ln.strip()]
        return {"status": "error", "error": f"exit {cp.returncode}: "
                + (tail[-1][:300] if tail else "no output")}
    res = json.loads(lines[-1])
    res["status"] = "ok" if res.get("verified") is not False else "error"
    if res["status"] == "error":
        res["error"] = "data did not land (verification failed)"
    return res


def measure(p: dict, args) -> dict:
    row = {k: p[k] for k in ("group", "point", "engine", "protocol")}
    row["cmd"] = " ".join(p["cmd"])
    if not installed(p["family"]):
        row["status"] = "not installed"
        return row
    metric, higher = METRIC[p["group"]]
    best, runs = None, []
    for _ in range(args.repeat):
        r = run_once(p, timeout=args.duration * 3 + 90)
        runs.append(r.get(metric) if r["status"] == "ok" else r["status"])
        if best is None or (r["status"] == "ok" and (
                best["status"] != "ok" or (r[metric] > best[metric]) == higher)):
            best = r
    r = dict(best)
    r.pop("engine", None), r.pop("protocol", None)  # keep the plan's labels
    row.update(r)
    if args.repeat > 1:
        row["runs"] = runs
    return row


def add_ratios(rows: list[dict]) -> None:
    """kvflow / best alternative engine, and kvflow / first ceiling, per point;
    a compat row (kvflow behind another engine's API) / that engine."""
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["group"], r["point"]), []).append(r)
    for (group, _), rs in by_point.items():
        metric, higher = METRIC[group]
        ok = [r for r in rs if r.get("status") == "ok" and r.get(metric)]
        alts = [r for r in ok if r["engine"] not in CEILINGS and r["engine"] != "kvflow"
                and r["engine"] not in COMPAT]
        ceil = [r for r in ok if r["engine"] in CEILINGS][:1]
        pick = max if higher else min
        for k in (r for r in ok if r["engine"] == "kvflow"):
            if alts:
                b = pick(alts, key=lambda r: r[metric])
                k["vs_best_alt"] = round(k[metric] / b[metric], 3)
                k["best_alt"] = f"{b['engine']} {b['protocol']}"
            if ceil:
                k["of_ceiling"] = round(k[metric] / ceil[0][metric], 3)
                k["ceiling"] = ceil[0]["engine"]
        for c in (r for r in ok if r["engine"] in COMPAT):
            base = [r for r in ok if r["engine"] == COMPAT[c["engine"]]]
            if base:        # that engine's best transport (NIXL: ucx-cma or ucx-sm, whichever won)
                b = pick(base, key=lambda r: r[metric])
                c["vs_best_alt"] = round(c[metric] / b[metric], 3)
                c["best_alt"] = f"{b['engine']} {b['protocol']}"


def _store_bench():
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import store_bench
    return store_bench


def store_rows_from(runs: list[dict], cmd: str) -> list[dict]:
    """compare rows from store_bench runs (run_system's dicts, any number
    per system: the best of each row is kept, as measure() keeps the best
    of --repeat). kvflow's raw tcp write/read and memcpy are the ceilings."""
    engine = {"kvflow": "kvflow", "mooncake": "mooncake"}
    picked: dict = {}
    for run in runs:
        system = run.get("system")
        for p in run.get("points", []):
            if p["op"] == "batch_exists":
                key = ("store-exists", f"{p['keys']} keys", engine[system], "tcp")
                row = {"latency_p50_us": p["p50_us"], "latency_p99_us": p["p99_us"]}
            elif p["op"] in ("put", "get", "raw_write", "raw_read", "memcpy"):
                op = {"raw_write": "put", "raw_read": "get"}.get(p["op"], p["op"])
                name = ("kvflow-raw" if p["op"].startswith("raw") else "memcpy" if p["op"] == "memcpy"
                        else engine[system])
                proto = "local" if name == "memcpy" else "tcp"
                for o in (("put", "get") if p["op"] == "memcpy" else (op,)):
                    r = {"gbps": p["gbps"], "bytes": p["size"] * p["batch"], "seconds": p["seconds_p50"],
                         "block_size": p["size"], "batch": p["batch"]}
                    key2 = ("store", f"{o} {fmt_size(p['size'])} x{p['batch']}", name, proto)
                    _keep_best(picked, key2, r, "gbps", True)
                continue
            else:
                continue
            _keep_best(picked, key, row, "latency_p50_us", False)
        if "error" in run:
            picked.setdefault(("store", "error", engine.get(system, system), "tcp"),
                              {"status": "error", "error": run["error"][-300:]})
    rows = []
    for (group, point, name, proto), r in picked.items():
        rows.append({"group": group, "point": point, "engine": name, "protocol": proto, "cmd": cmd,
                     "status": r.pop("status", "ok"), **r})
    order = {"kvflow": 0, "mooncake": 1, "kvflow-raw": 2, "memcpy": 3}
    rows.sort(key=lambda r: (STORE_GROUPS.index(r["group"]), _store_point_order(r["point"]),
                             order.get(r["engine"], 9)))
    return rows


def _keep_best(picked: dict, key: tuple, row: dict, metric: str, higher: bool) -> None:
    old = picked.get(key)
    runs = (old or {}).get("runs", []) + [row[metric]]
    if old is None or (row[metric] > old[metric]) == higher:
        picked[key] = dict(row)
    picked[key]["runs"] = runs


def _store_point_order(point: str) -> tuple:
    op, _, rest = point.partition(" ")
    size = rest.split(" x")[0]
    return (parse_size(size.replace(" ", "")) if size and size[0].isdigit() else 0, op != "put")


def store_rows(args) -> list[dict]:
    """Runs store_bench's systems (kvflow, then Mooncake Store when it is
    installed and asked for), --repeat times, alternating; their rows."""
    sb = _store_bench()
    sizes = ",".join(str(s) for s in args.store_sizes)
    sb_args = sb.parser().parse_args(["--sizes", sizes, "--batch", str(args.batch), "--rounds", str(args.store_rounds),
                                      "--protocol", "tcp", "--exists-keys", "128"])
    systems = [s for s, fam in (("kvflow", ("kvflow", "ceilings")), ("mooncake", ("mooncake",)))
               if any(f in args.only for f in fam)]
    cmd = f"python tools/store_bench.py --sizes {sizes} --batch {args.batch} --rounds {args.store_rounds} --mooncake"
    runs, missing = [], []
    for _ in range(args.repeat):
        for system in systems:
            if system == "mooncake" and not installed("mooncake"):
                missing.append(system)
                continue
            t0 = time.monotonic()
            run = sb.run_system(system, sb_args)
            runs.append(run)
            print(f"[store {time.monotonic() - t0:5.0f}s] {system}: "
                  + ("error" if "error" in run else f"{len(run.get('points', []))} points"),
                  file=sys.stderr, flush=True)
    rows = store_rows_from(runs, cmd)
    for system in dict.fromkeys(missing):
        rows.append({"group": "store", "point": "-", "engine": system, "protocol": "tcp", "cmd": cmd,
                     "status": "not installed"})
    family = {"kvflow": "kvflow", "mooncake": "mooncake", "kvflow-raw": "ceilings", "memcpy": "ceilings"}
    return [r for r in rows if family.get(r["engine"], r["engine"]) in args.only and r["group"] in args.groups]


# --------------------------------------------------------------------------- output
LEGEND = ("Ratios: kvflow's metric / the best other engine's and / the group's first "
          "ceiling (a mooncake-compat row: kvflow's Mooncake API / Mooncake's); GB/s and "
          "entries/s: >1 favours kvflow; lat-* and store-exists rows compare p50 latency: <1 favours kvflow.")
COLS = ("group", "point", "engine", "protocol", "GB/s", "entries/s", "p50 us",
        "p99 us", "kvflow / best alt", "of ceiling")


def metric_cells(r: dict, gbps_fmt: str = "{:.3f}") -> list[str]:
    """GB/s, entries/s, p50 and p99 of one row, or its status and blanks."""
    def num(key, fmt):
        v = r.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else ""

    if r.get("status") != "ok":
        return [r.get("status", "error")] + [""] * 3
    return [num("gbps", gbps_fmt), num("entries_per_s", "{:,.0f}"),
            num("latency_p50_us", "{:.1f}"), num("latency_p99_us", "{:.1f}")]


def cells(r: dict) -> list[str]:
    vals = metric_cells(r)
    alt = f"{r['vs_best_alt']:.2f}x {r['best_alt']}" if "vs_best_alt" in r else ""
    ceil = f"{r['of_ceiling']:.2f}x {r['ceiling']}" if "of_ceiling" in r else ""
    return [r["group"], r["point"], r["engine"], r["protocol"]] + vals + [alt, ceil]


def format_table(cols, table: list[list[str]], markdown: bool, blocks: list | None = None) -> list[str]:
    """Rows of cells as markdown, or as aligned text with a blank line
    wherever `blocks` (one key per row) changes. Shared with compare_rdma."""
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return out + ["| " + " | ".join(c.replace("|", "\\|") for c in cs) + " |" for cs in table]
    widths = [max(len(x) for x in col) for col in zip(cols, *table)]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()
    out, last = [line(cols), line(["-" * w for w in widths])], None
    for key, c in zip(blocks or [None] * len(table), table):
        if last is not None and key != last:
            out.append("")
        last = key
        out.append(line(c))
    return out


def render(rows: list[dict], markdown: bool) -> str:
    return "\n".join(format_table(COLS, [cells(r) for r in rows], markdown, [r["group"] for r in rows]))


def versions() -> dict:
    from importlib import metadata

    v = {"python": platform.python_version(), "cpus": os.cpu_count(),
         "machine": platform.machine(), "kernel": platform.release()}
    for dist in ("numpy", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
                 "nixl-cu12", "nixl-cu13", "nixl"):
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return v


def plot_rows(rows: list[dict], path: str) -> str:
    """The table as grouped bars, one panel per group: each point's metric
    per engine (kvflow first), the kvflow / best-alternative ratio written
    over kvflow's bar. Needs matplotlib."""
    sys.path.insert(0, ROOT)
    from kvflow.cli.bench_plot import pyplot
    plt = pyplot()
    groups = list(dict.fromkeys(r["group"] for r in rows if r.get("status") == "ok"))
    if not groups:
        raise SystemExit("compare.py: nothing measured, nothing to plot")
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 3.6 * len(groups)), squeeze=False)
    for ax, group in zip((a[0] for a in axes), groups):
        metric, higher = METRIC[group]
        ok = [r for r in rows if r["group"] == group and r.get("status") == "ok" and r.get(metric)]
        points = list(dict.fromkeys(r["point"] for r in ok))
        series = list(dict.fromkeys(f"{r['engine']} {r['protocol']}" for r in ok
                                    if r["engine"] == "kvflow"))
        series += [x for x in dict.fromkeys(f"{r['engine']} {r['protocol']}" for r in ok) if x not in series]
        width = 0.8 / max(1, len(series))
        for i, name in enumerate(series):
            xs, ys, ratio = [], [], []
            for j, pt in enumerate(points):
                r = next((r for r in ok if r["point"] == pt and f"{r['engine']} {r['protocol']}" == name), None)
                if r is not None:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    ys.append(r[metric])
                    ratio.append(r.get("vs_best_alt"))
            bars = ax.bar(xs, ys, width, label=name)
            for bar, q in zip(bars, ratio):
                if q is not None:
                    ax.annotate(f"{q:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(points)), points)
        ax.set_ylabel(metric + ("" if higher else " (lower is better)"))
        ax.set_title(TITLE.get(group, group), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--duration", type=float, default=3.0, help="seconds per point (3)")
    p.add_argument("--sizes", default="4K,64K,1M,16M",
                   type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                   help="block sizes for the tcp/local throughput groups")
    p.add_argument("--batch", type=int, default=64, help="entries per batch (64)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="batches in flight for the throughput groups (2)")
    p.add_argument("--scatter-concurrency", type=int, default=4,
                   help="batches in flight for the scatter group (4)")
    p.add_argument("--only", default=",".join(ENGINES),
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="comma list of: " + ", ".join(ENGINES))
    p.add_argument("--groups", default=",".join(METRIC),
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="comma list of: " + ", ".join(METRIC))
    p.add_argument("--store-sizes", default="64K,1M,4M",
                   type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                   help="object sizes for the store group (64K,1M,4M)")
    p.add_argument("--store-rounds", type=int, default=5,
                   help="timed batch calls per store point, the median kept (5)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each point N times and keep the best (noisy shared cores)")
    p.add_argument("--json", metavar="FILE", help="write all rows (and versions) as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the table as bars (needs matplotlib)")
    p.add_argument("--from-json", metavar="FILE", help="do not measure: render (and --plot) a --json file")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
        print(render(rows, args.markdown))
        if args.plot:
            print(f"wrote {plot_rows(rows, args.plot)}", file=sys.stderr)
        return 0
    bad = [x for x in args.only if x not in ENGINES] + [g for g in args.groups if g not in METRIC]
    if bad:
        p.error(f"unknown --only/--groups value(s): {', '.join(bad)}")

    points = [x for x in plan(args) if x["group"] in args.groups]
    rows = []
    t0 = time.monotonic()
    for i, pt in enumerate(points, 1):
        r = measure(pt, args)
        rows.append(r)
        metric = METRIC[pt["group"]][0]
        shown = r.get(metric) if r.get("status") == "ok" else r.get("status")
        print(f"[{i}/{len(points)} {time.monotonic() - t0:5.0f}s] {pt['group']:9} "
              f"{pt['point']:14} {pt['engine']:17} {pt['protocol']:8} {metric}={shown}"
              + (f"  ({r['error']})" if r.get("error") else ""), file=sys.stderr, flush=True)
    if any(g in STORE_GROUPS for g in args.groups):
        rows += store_rows(args)
    add_ratios(rows)
    print(render(rows, args.markdown))
    print(("\n" if args.markdown else "") + LEGEND)
    if args.plot:
        print(f"wrote {plot_rows(rows, args.plot)}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "args": {k: v for k, v in vars(args).items()
                                                        if k != "json"}, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
