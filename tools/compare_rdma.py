#!/usr/bin/env python3
"""kvflow rdma vs Mooncake TE rdma vs perftest, on one RDMA device; one table.

Meant to run INSIDE the Soft-RoCE VM (there is no RDMA on the build host):

    python3 tools/rdma_vm.py --timeout 1800 -- python3 tools/compare_rdma.py --markdown
    python3 tools/rdma_vm.py --rwdir /tmp/rdma-out -- \\
        python3 tools/compare_rdma.py --markdown --json /tmp/rdma-out/rdma.json

On a machine without the device it refuses (exit 2).  Every measurement runs
in its own subprocess(es) with a timeout; one that fails becomes an "error"
row carrying its message (the run goes on).

Points (all `write`, one device, initiator and target on the same rxe port):
  bw    batch 64 entries, --concurrency batches in flight (default 2), GB/s:
          4 KiB x64, 4 KiB x64 scattered (a one-block gap between entries, so
          nothing can be coalesced), 64 KiB x64, 1 MiB x64.
        kvflow      python -m kvflow.cli.bench pair --protocol rdma ... --verify
        mooncake    tools/baselines/mooncake_bench.py --protocol rdma --device D,
                    twice: Mooncake's default workers, and MC_WORKERS_PER_CTX=1
        ib_write_bw perftest, -s SIZE -D duration, one QP, ~2 MiB in flight
                    (-t 128/32/2, see plan()): the device's reference at 4K /
                    64K / 1M; the scattered 4 KiB point uses the 4K one.
  lat   one 4 KiB write at a time (batch 1, concurrency 1), p50 in us:
        kvflow, Mooncake (both configs): await/submit to completion, i.e. a
        full round trip; ib_write_lat's t_typical (median) is HALF a round
        trip (ping-pong / 2), so the row "2x ib_write_lat" doubles it and that
        is the reference kvflow is divided by.

Column "retx": the device's retransmissions during the measurement
(hw_counters completer_retry_err, which rxe counts when its RC ACK timer ran
out and it sent a message again: the requester and responder share the
device, so this is every engine's own stall, not noise from the others);
the other non-zero counter deltas are in --json.

Columns: "kvflow / ceiling" = kvflow's metric / ib_write_bw's (bw) or / 2x
ib_write_lat's (lat); "kvflow / best Mooncake" = kvflow / the better of the
two Mooncake configs.  With --repeat N a row shows its best run; "median" is
the median over its runs, and each ratio is also given median / median (the
best of N follows the one lucky run; the median is the steadier figure in a
VM whose speed drifts by +-20% between runs).  GB/s: >1 favours kvflow;
latency: <1 favours kvflow.
Inside the TCG VM everything is emulated (~60 MB/s over rxe): only ratios
within one run mean anything, and other VMs on the host skew them.
Stdlib only (the baselines themselves need numpy and Mooncake).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import fmt_size, format_table, metric_cells, parse_size, point_args  # noqa: E402  (shared with the host comparison)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tools", "baselines")

W1 = {"MC_WORKERS_PER_CTX": "1"}
TITLE = {"bw": "write, batch 64, GB/s", "lat": "one 4 KiB write, p50 us"}
METRIC = {"bw": ("gbps", True), "lat": ("latency_p50_us", False)}


def log(msg: str) -> None:
    print(f"compare_rdma: {msg}", file=sys.stderr, flush=True)


def default_device() -> str:
    names = [d.strip() for d in os.environ.get("KVFLOW_RDMA_DEVICES", "").split(",") if d.strip()]
    return names[0] if names else "rxe0"


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


# --------------------------------------------------------------------------- plan
def plan(args) -> list[dict]:
    """Every measurement, in run order.  kind: json (prints a JSON row), bw/lat (perftest)."""
    out: list[dict] = []
    py = sys.executable

    def add(group, point, engine, config, kind, cmd, env=None, **kw):
        out.append({"group": group, "point": point, "engine": engine, "config": config,
                    "kind": kind, "cmd": cmd, "env": env or {}, **kw})

    def kvflow(pa):
        return [py, "-m", "kvflow.cli.bench", "pair", "--protocol", "rdma"] + pa + \
               ["--json", "--no-progress", "--verify"]

    def mooncake(pa):
        return [py, os.path.join(BASE, "mooncake_bench.py"), "--protocol", "rdma",
                "--device", args.device] + pa

    d, c, b = args.duration, args.concurrency, args.batch
    points = [(bs, False) for bs in args.sizes]
    if args.scatter and 4096 in args.sizes:
        points.insert(args.sizes.index(4096) + 1, (4096, True))
    for bs, scatter in points:
        label = f"{fmt_size(bs)} x{b}" + (" scattered" if scatter else "")
        pa = point_args(bs, b, d, c, scatter)
        add("bw", label, "kvflow", "", "json", kvflow(pa), block=bs)
        add("bw", label, "mooncake", "default", "json", mooncake(pa), block=bs)
        add("bw", label, "mooncake", "MC_WORKERS_PER_CTX=1", "json", mooncake(pa), W1, block=bs)
        if not scatter:
            # perftest's defaults (TX depth 128, one CQE per 100 writes) stall on rxe with
            # big messages: 128 x 1 MiB in flight made no completion at all in 3 s.  Keep
            # ~2 MiB in flight and a CQE every quarter of the TX depth (4K: -t 128 -Q 32,
            # 64K: -t 32 -Q 8, 1M: -t 2 -Q 1).
            txd = max(2, min(128, (2 << 20) // bs))
            cqmod = max(1, min(100, txd // 4))
            secs = max(1, round(d))
            # -D counts only writes completed inside its window: when a slow run (another
            # VM on the host) completes none of them, perftest prints 0 or "Can't produce a
            # report".  Then the point is retried with a fixed count, ~20 MB/s x duration.
            common = ["ib_write_bw", "-d", args.device, "-x", str(args.gid_index), "-s", str(bs),
                      "-t", str(txd), "-Q", str(cqmod)]
            iters = max(2 * txd, int(d * 20e6 / bs))
            add("bw", label, "ib_write_bw", f"-s {bs} -D {secs} -t {txd} -Q {cqmod}", "bw",
                common + ["-D", str(secs)], block=bs,
                fallback=(f"-s {bs} -n {iters} -t {txd} -Q {cqmod}", common + ["-n", str(iters)]))
    pa = point_args(4096, 1, d, 1, False)
    add("lat", "4 KiB x1", "kvflow", "", "json", kvflow(pa))
    add("lat", "4 KiB x1", "mooncake", "default", "json", mooncake(pa))
    add("lat", "4 KiB x1", "mooncake", "MC_WORKERS_PER_CTX=1", "json", mooncake(pa), W1)
    add("lat", "4 KiB x1", "ib_write_lat", f"-s 4096 -n {args.lat_iters}", "lat",
        ["ib_write_lat", "-d", args.device, "-x", str(args.gid_index), "-s", "4096",
         "-n", str(args.lat_iters)])
    return [p for p in out if p["engine"] in args.only]


# --------------------------------------------------------------------------- running
def hw_counters(device: str, port: int = 1) -> dict[str, int]:
    """The device port's hardware counters (rxe: packets, retries, sequence
    errors); {} where the driver has none."""
    base = f"/sys/class/infiniband/{device}/ports/{port}/hw_counters"
    out = {}
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(base, name)) as f:
                out[name] = int(f.read().strip())
        except (OSError, ValueError):
            continue
    return out


def counter_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(after) if k in before and after[k] != before[k]}


def _tail(text: str, n: int = 300) -> str:
    """The last meaningful line of a tool's output (Mooncake logs one INFO line per batch)."""
    lines = [ln.strip() for ln in (text or "").splitlines()
             if ln.strip() and "Batch Transfer completed" not in ln]
    errs = [ln for ln in lines if re.match(r"[EF]\d{4} ", ln) or "rror" in ln or "ailed" in ln]
    pick = (errs or lines)[-1:] if (errs or lines) else ["no output"]
    return pick[0][:n]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def run_cmd(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(returncode or None on timeout, stdout, stderr); the whole process group dies on timeout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill(proc)
        return None, "", ""


def run_json(p: dict, timeout: float) -> dict:
    rc, out, err = run_cmd(p["cmd"], p["env"], timeout)
    if rc is None:
        return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        return {"status": "error", "error": f"exit {rc}: {_tail(err or out)}"}
    res = json.loads(lines[-1])
    if res.get("verified") is False:
        return {**res, "status": "error", "error": "data did not land (verification failed)"}
    return {**res, "status": "ok"}


def _listening(port: int) -> bool:
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return False


def parse_perftest(text: str) -> dict[str, float] | None:
    """The result line under perftest's '#bytes ...' header, keyed by column name."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            head = re.sub(r"BW (peak|average)", r"BW_\1", line.strip())
            head = re.sub(r"(\d+(?:\.\d+)?%) percentile", r"p\1", head)
            names = [re.sub(r"\[.*\]$", "", t).lstrip("#") for t in head.split()]
            for nxt in lines[i + 1:]:
                vals = nxt.split()
                if vals and re.fullmatch(r"\d+", vals[0]):
                    try:
                        return {n: float(v) for n, v in zip(names, vals)}
                    except ValueError:
                        return None
    return None


_port = [18700]


def run_perftest(p: dict, timeout: float) -> dict:
    """Server in the background, client against 127.0.0.1, each on a fresh port."""
    _port[0] += 1
    port = str(_port[0])
    base = p["cmd"] + ["-p", port]
    server = subprocess.Popen(base, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not _listening(int(port)):
            if server.poll() is not None:
                out, _ = server.communicate()
                return {"status": "error", "error": f"server exit {server.returncode}: {_tail(out)}"}
            if time.monotonic() > deadline:
                return {"status": "error", "error": "server did not listen within 30 s"}
            time.sleep(0.1)
        rc, out, err = run_cmd(base + ["127.0.0.1"], {}, timeout)
        if rc is None:
            return {"status": "error", "error": f"timed out after {timeout:.0f} s"}
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if rc != 0:
            return {"status": "error", "error": f"exit {rc}: {_tail(out + err)}"}
        vals = parse_perftest(out)
        if not vals:
            return {"status": "error", "error": f"no result line in: {_tail(out + err)}"}
        res = {"status": "ok", "perftest": vals, "port": int(port)}
        if p["kind"] == "bw":
            mib = vals.get("BW_average")  # MB/sec, where perftest's MB is 2^20 bytes
            if mib is None:
                return {"status": "error", "error": f"no 'BW average' column: {vals}"}
            if mib <= 0:
                return {"status": "error", "perftest": vals,
                        "error": f"ib_write_bw measured 0 MB/s ({vals.get('iterations', 0):.0f} "
                                 "writes completed in the run)"}
            res["gbps"] = round(mib * (1 << 20) / 1e9, 4)
            if vals.get("MsgRate"):
                res["entries_per_s"] = round(vals["MsgRate"] * 1e6, 1)
        else:
            typ = vals.get("t_typical")
            if typ is None:
                return {"status": "error", "error": f"no t_typical column: {vals}"}
            if not math.isfinite(typ):
                # seen under TCG: perftest's cycles-per-microsecond estimate came out 0
                return {"status": "error", "perftest": vals,
                        "error": f"ib_write_lat printed t_typical={typ} (its clock estimate failed)"}
            res["latency_p50_us"] = typ  # half a round trip
            if "p99%" in vals:
                res["latency_p99_us"] = vals["p99%"]
        return res
    finally:
        if server.poll() is None:
            _kill(server)


def measure_once(p: dict, args) -> dict:
    """One run of a measurement (with perftest's fallback), and the device's
    counter deltas over it (retx: completer_retry_err)."""
    timeout = args.duration * 4 + args.timeout_extra
    before = hw_counters(args.device)
    r = run_json(p, timeout) if p["kind"] == "json" else run_perftest(p, timeout)
    if r["status"] != "ok" and p.get("fallback"):
        config, cmd = p["fallback"]
        r2 = run_perftest({**p, "cmd": cmd}, timeout)
        r2["retried"] = f"{p['config']}: {r['error']}"
        if r2["status"] == "ok":
            r2.update(config=config, cmd=" ".join(cmd))
        else:
            r2["error"] = f"{r['error']}; retry with {config}: {r2['error']}"
        r = r2
    r["counters"] = counter_deltas(before, hw_counters(args.device))
    if before:
        r["retx"] = r["counters"].get("completer_retry_err", 0)
    return r


def best_row(p: dict, results: list[dict]) -> dict:
    """The row of a measurement: its best run (all runs' values in "runs")."""
    row = {k: p[k] for k in ("group", "point", "engine", "config")}
    if "block" in p:
        row["block_size"] = p["block"]
    env = " ".join(f"{k}={v}" for k, v in p["env"].items())
    row["cmd"] = (env + " " if env else "") + " ".join(p["cmd"])
    metric, higher = METRIC[p["group"]]
    best = None
    for r in results:
        if best is None or (r["status"] == "ok" and (
                best["status"] != "ok" or (r[metric] > best[metric]) == higher)):
            best = r
    r = dict(best)
    for k in ("engine", "protocol"):
        r.pop(k, None)
    row.update(r)
    if len(results) > 1:
        row["runs"] = [x.get(metric) if x["status"] == "ok" else x["status"] for x in results]
        ok = [x[metric] for x in results if x["status"] == "ok" and x.get(metric) is not None]
        if ok:
            row["median"] = statistics.median(ok)
    if p["engine"] == "mooncake" and r["status"] == "error":
        row["status"] = "does not run"
    return row


def add_derived(rows: list[dict]) -> list[dict]:
    """Insert '2x ib_write_lat' after ib_write_lat, and the ratios on kvflow rows."""
    out = []
    for r in rows:
        out.append(r)
        if r["engine"] == "ib_write_lat" and r.get("status") == "ok":
            out.append({"group": r["group"], "point": r["point"], "engine": "2x ib_write_lat",
                        "config": "full round trip", "status": "ok", "derived": True,
                        "latency_p50_us": round(2 * r["latency_p50_us"], 2),
                        "median": round(2 * r["median"], 2) if r.get("median") else None,
                        "latency_p99_us": round(2 * r["latency_p99_us"], 2)
                        if r.get("latency_p99_us") else None})
    ceilings = {}  # block size -> ib_write_bw row
    for r in out:
        if r["engine"] == "ib_write_bw" and r.get("status") == "ok" and r.get("gbps"):
            ceilings[r.get("block_size") or r.get("block")] = r
    by_point: dict = {}
    for r in out:
        by_point.setdefault((r["group"], r["point"]), []).append(r)
    for (group, _), rs in by_point.items():
        metric, higher = METRIC[group]
        ok = [r for r in rs if r.get("status") == "ok" and r.get(metric)]
        mc = [r for r in ok if r["engine"] == "mooncake"]
        for k in (r for r in ok if r["engine"] == "kvflow"):
            if group == "bw":
                ceil = ceilings.get(k.get("block_size"))
            else:
                ceil = next((r for r in ok if r["engine"] == "2x ib_write_lat"), None)
            if ceil and ceil.get(metric):
                k["ceiling"] = ceil["engine"] + (f" {fmt_size(ceil['block_size'])}"
                                                 if group == "bw" else "")
            # best run / best run, and (with --repeat) median / median
            for key, pre in ((metric, ""), ("median", "median_")):
                if not k.get(key):
                    continue
                if ceil and ceil.get(key):
                    k[pre + "vs_ceiling"] = round(k[key] / ceil[key], 3)
                ref = [r for r in mc if r.get(key)]
                if ref:
                    b = (max if higher else min)(ref, key=lambda r: r[key])
                    k[pre + "vs_best_mooncake"] = round(k[key] / b[key], 3)
                    if not pre:
                        k["best_mooncake"] = b["config"]
    return out


# --------------------------------------------------------------------------- output
COLS = ("group", "point", "engine", "config", "GB/s", "entries/s", "p50 us", "p99 us", "median",
        "retx", "kvflow / ceiling", "kvflow / best Mooncake")
LEGEND = ("bw: GB/s = 10^9 B/s, batch of 64 writes, ratios >1 favour kvflow; ceiling = "
          "ib_write_bw at the same block size.  lat: one 4 KiB write awaited to completion "
          "(a full round trip); ib_write_lat's t_typical is half a round trip, so kvflow is "
          "divided by 2x ib_write_lat; ratios <1 favour kvflow.  With --repeat N each row shows "
          "its best run, 'median' the median of its runs (GB/s or p50 us), and the ratios are "
          "best/best with median/median beside them.  'does not run' / 'error': "
          "see the notes below the table (and --json).")


def cells(r: dict) -> list[str]:
    vals = metric_cells(r, "{:.4f}")
    med = r.get("median") if r.get("status") == "ok" else None
    med = "" if med is None else (f"{med:.4f}" if r["group"] == "bw" else f"{med:.1f}")
    ceil = f"{r['vs_ceiling']:.2f}x" if "vs_ceiling" in r else ""
    if "median_vs_ceiling" in r:
        ceil += f" (median {r['median_vs_ceiling']:.2f}x)"
    mc = f"{r['vs_best_mooncake']:.2f}x ({r['best_mooncake']})" if "vs_best_mooncake" in r else ""
    if "median_vs_best_mooncake" in r:
        mc += f", median {r['median_vs_best_mooncake']:.2f}x"
    retx = str(r["retx"]) if "retx" in r else ""
    return [r["group"], r["point"], r["engine"], r["config"]] + vals + [med, retx, ceil, mc]


def render(rows: list[dict], markdown: bool) -> str:
    out = format_table(COLS, [cells(r) for r in rows], markdown, [r["point"] for r in rows])
    notes = [f"- {r['point']} {r['engine']} {r['config']}: {r['error']}"
             for r in rows if r.get("status") != "ok" and r.get("error")]
    notes += [f"- {r['point']} {r['engine']}: first try failed ({r['retried']}), "
              f"shown: {r['config']}" for r in rows if r.get("retried") and r.get("status") == "ok"]
    if notes:
        out += ["", "Notes:" if not markdown else "**Notes:**", *notes]
    return "\n".join(out)


def versions(device: str) -> dict:
    from importlib import metadata

    v = {"python": platform.python_version(), "cpus": os.cpu_count(),
         "machine": platform.machine(), "kernel": platform.release(),
         "in_vm": os.environ.get("KVFLOW_IN_VM") == "1", "device": device}
    for dist in ("numpy", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "kvflow"):
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:  # which kvflow was measured: the commit, and whether kvflow/ differs from it
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kvflow"], cwd=ROOT,
                               capture_output=True, timeout=20).returncode
        if head:
            v["kvflow_commit"] = head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        p = subprocess.run(["ib_write_bw", "--version"], capture_output=True, text=True, timeout=10)
        v["perftest"] = (p.stdout + p.stderr).strip().splitlines()[-1][:80]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return v


def main(argv=None) -> int:
    doc = __doc__.splitlines()
    p = argparse.ArgumentParser(description=doc[0], epilog="\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(),
                   help="RDMA device (default: first of $KVFLOW_RDMA_DEVICES, else rxe0)")
    p.add_argument("--gid-index", type=int, default=1,
                   help="perftest -x GID index (default 1: ::ffff:127.0.0.1 RoCE v2 on rxe0 over lo)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per point (3)")
    p.add_argument("--sizes", default="4K,64K,1M",
                   type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                   help="block sizes of the bw group (4K,64K,1M)")
    p.add_argument("--no-scatter", dest="scatter", action="store_false",
                   help="skip the scattered 4 KiB point")
    p.add_argument("--batch", type=int, default=64, help="entries per batch (64)")
    p.add_argument("--concurrency", type=int, default=2, help="batches in flight, bw group (2)")
    p.add_argument("--lat-iters", type=int, default=1000, help="ib_write_lat -n (1000)")
    p.add_argument("--only", default="kvflow,mooncake,ib_write_bw,ib_write_lat",
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="engines to run (comma list of kvflow, mooncake, ib_write_bw, ib_write_lat)")
    p.add_argument("--repeat", type=int, default=1, help="run the whole plan N times (rounds), keep each point's best")
    p.add_argument("--timeout-extra", type=float, default=150.0,
                   help="per-measurement timeout = 4 x duration + this many seconds (150)")
    p.add_argument("--json", metavar="FILE", help="write all rows (and versions) as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)

    devs = rdma_devices()
    if args.device not in devs:
        have = ", ".join(devs) if devs else "none (/sys/class/infiniband is empty or missing)"
        print(f"compare_rdma: no RDMA device {args.device!r} on this machine (devices: {have}).\n"
              "Run it inside the Soft-RoCE VM:\n"
              "  python3 tools/rdma_vm.py --timeout 1800 -- python3 tools/compare_rdma.py --markdown",
              file=sys.stderr)
        return 2

    points = plan(args)
    # --repeat runs the whole plan again (rounds), rather than one point N
    # times in a row: a noisy stretch of the host then hits one run of every
    # engine, not all the runs of one.
    results: list[list[dict]] = [[] for _ in points]
    t0 = time.monotonic()
    for rnd in range(1, args.repeat + 1):
        for i, pt in enumerate(points):
            r = measure_once(pt, args)
            results[i].append(r)
            metric = METRIC[pt["group"]][0]
            shown = r.get(metric) if r.get("status") == "ok" else r.get("status")
            log(f"[{rnd}/{args.repeat} {i + 1}/{len(points)} {time.monotonic() - t0:5.0f}s] "
                f"{pt['point']:18} {pt['engine']:12} {pt['config']:22} {metric}={shown} "
                f"retx={r.get('retx', '-')}" + (f"  ({r['error']})" if r.get("error") else ""))
    rows = add_derived([best_row(pt, res) for pt, res in zip(points, results)])
    wall = time.monotonic() - t0
    print(render(rows, args.markdown))
    print(("\n" if args.markdown else "") + LEGEND)
    print(f"\n{len(points)} measurements in {wall:.0f} s on {args.device} "
          f"(cpus={os.cpu_count()}, kernel {platform.release()}).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(args.device), "wall_s": round(wall, 1),
                       "args": {k: v for k, v in vars(args).items() if k != "json"},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
