"""kvflow-bench, run as users run it: real target processes, real sockets.
What it reports is checked against what it was asked to move, and --verify
against the target's memory (a checksum the target computes itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvflow.cli.bench import Layout

FIELDS = {"protocol", "op", "block_size", "batch", "bytes", "seconds", "gbps",
          "latency_p50_us", "latency_p99_us", "entries_per_s"}
TIMEOUT = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "kvflow.cli.bench", *args], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env, stdin=subprocess.DEVNULL)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def results(p: subprocess.CompletedProcess[str]) -> list[dict]:
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("protocol,op", [("tcp", "write"), ("tcp", "read"), ("local", "write")])
def test_pair_moves_exactly_the_bytes_asked_and_they_verify(protocol, op):
    total = 8 << 20
    r, = results(bench("pair", "--protocol", protocol, "--op", op, "--block-size", "64K", "--batch", "16",
                       "--total-bytes", str(total), "--warmup", "0.1", "--verify", "--json", "--no-progress"))
    assert FIELDS <= set(r)
    assert (r["protocol"], r["op"], r["block_size"], r["batch"]) == (protocol, op, 65536, 16)
    assert r["bytes"] == total                      # 8 batches of 1 MiB, no more (the budget)
    assert r["verified"] is True
    assert r["seconds"] > 0 and r["gbps"] == pytest.approx(total / r["seconds"] / 1e9, rel=0.01)
    assert 0 < r["latency_p50_us"] <= r["latency_p99_us"]
    assert r["entries_per_s"] == pytest.approx(total / 65536 / r["seconds"], rel=0.01)


def test_sweep_with_scattered_entries_reports_one_row_per_size():
    rows = results(bench("pair", "--protocol", "tcp", "--block-size", "4K,64K", "--sweep", "--scatter",
                         "--batch", "8", "--duration", "0.3", "--warmup", "0.1", "--verify", "--json",
                         "--no-progress"))
    assert [r["block_size"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["verified"] is True
        # a whole number of batches, measured after the warmup was drained
        assert r["bytes"] % (8 * r["block_size"]) == 0 and r["bytes"] > 0


def test_target_and_initiator_as_separate_processes():
    target = subprocess.Popen([sys.executable, "-m", "kvflow.cli.bench", "target", "--listen", "127.0.0.1:0",
                               "--buffer-size", "4M"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        line = target.stdout.readline()
        assert line.startswith("KVFLOW_TARGET "), line + target.stderr.read()
        address = line.split()[1]
        r, = results(bench("initiator", "--target", address, "--protocol", "tcp", "--block-size", "16K",
                           "--batch", "4", "--total-bytes", "1M", "--verify", "--json", "--no-progress"))
        assert r["bytes"] == 1 << 20 and r["verified"] is True
    finally:
        target.terminate()
        assert target.wait(timeout=30) == 0


def test_human_output_is_a_table():
    p = bench("pair", "--protocol", "tcp", "--block-size", "4K", "--batch", "4", "--total-bytes", "64K",
              "--no-progress")
    header = [line for line in p.stdout.splitlines() if line.startswith("protocol")]
    assert header and "GB/s" in header[0]


@pytest.mark.parametrize("args,message", [
    (["--block-size", "0"], "size must be positive"),
    (["--batch", "0"], "--batch"),
    (["--protocol", "carrier-pigeon"], "--protocol"),
])
def test_bad_options_are_refused_with_a_message(args, message):
    p = bench("pair", *args, check=False)
    assert p.returncode == 2
    assert message in p.stderr


def test_an_unreachable_target_is_a_clear_error():
    p = bench("initiator", "--target", "127.0.0.1:1", "--total-bytes", "64K", "--no-progress", check=False)
    assert p.returncode != 0
    assert "127.0.0.1:1" in p.stderr and "Traceback" not in p.stderr


def test_layout_wraps_inside_max_region_and_slots_do_not_overlap():
    layout = Layout(block_size=16 << 20, batch=64, concurrency=2, scatter=False, max_region=256 << 20)
    assert layout.distinct_entries == 16 and layout.span == 256 << 20
    local, remote, lengths = layout.slot_arrays(1, 0x1000, 0x2000)
    assert (local - 0x1000 == remote - 0x2000).all()
    assert int((local - 0x1000).max()) + (16 << 20) <= layout.span
    assert (lengths == 16 << 20).all()
    small = Layout(block_size=4096, batch=8, concurrency=2, scatter=True, max_region=256 << 20)
    a = small.slot_arrays(0, 0, 0)[0]
    b = small.slot_arrays(1, 0, 0)[0]
    assert not set(a.tolist()) & set(b.tolist())       # each slot its own entries
    assert np.all(np.diff(np.sort(np.concatenate([a, b]))) == 2 * 4096)   # a gap after each


def test_progress_lines_in_a_log_and_the_metrics_summary():
    """--progress writes progress to a stderr that is not a terminal, one
    line each; a human run ends with what the engine's counters saw."""
    p = bench("pair", "--protocol", "tcp", "--block-size", "64K", "--batch", "8", "--duration", "2.5",
              "--warmup", "0", "--progress")
    lines = [ln for ln in p.stderr.splitlines() if "GB/s" in ln]
    assert len(lines) >= 2 and all("\r" not in ln for ln in lines), p.stderr[-2000:]
    summary = [ln for ln in p.stderr.splitlines() if "metrics (tcp)" in ln]
    assert summary and "write " in summary[0] and "0 failed" in summary[0], p.stderr[-2000:]


def test_sweep_over_block_sizes_and_batches_with_a_plot(tmp_path):
    """--batch takes a list with --sweep (a row per batch and size) and
    --plot draws the sweep (throughput and latency against block size)."""
    png = tmp_path / "sweep.png"
    rows = results(bench("pair", "--protocol", "tcp", "--block-size", "4K,64K", "--batch", "4,16", "--sweep",
                         "--duration", "0.2", "--warmup", "0.05", "--json", "--no-progress", "--plot", str(png)))
    assert [(r["batch"], r["block_size"]) for r in rows] == [(4, 4096), (4, 65536), (16, 4096), (16, 65536)]
    assert all(r["bytes"] > 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = bench("pair", "--batch", "4,16", check=False)
    assert p.returncode == 2 and "--sweep" in p.stderr
    p = bench("pair", "--plot", str(tmp_path / "no" / "such" / "dir.png"), "--total-bytes", "64K",
              "--no-progress", check=False)
    assert p.returncode == 1 and "cannot write" in p.stderr and "Traceback" not in p.stderr


def test_compare_plots_the_side_by_side_table(tmp_path):
    """tools/compare.py --plot draws the table it measured; --from-json
    redraws a saved run without measuring."""
    out, png, png2 = tmp_path / "rows.json", tmp_path / "cmp.png", tmp_path / "again.png"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--only", "kvflow,ceilings",
                        "--groups", "tcp", "--sizes", "64K", "--duration", "0.3", "--json", str(out),
                        "--plot", str(png)], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["engine"] for r in rows if r.get("status") == "ok"} == {"kvflow", "socket"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--from-json", str(out),
                        "--plot", str(png2)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and "64 KiB" in p.stdout and png2.read_bytes()[:4] == b"\x89PNG"


def test_compare_ratio_of_a_compat_row_is_against_the_engines_best_transport():
    """kvflow.compat.nixl's row is divided by NIXL's best transport of the
    point (ucx-sm or ucx-cma, whichever was faster), not by the first."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "tools", "compare.py"))
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    row = {"group": "local", "point": "4 KiB", "status": "ok"}
    rows = [dict(row, engine="nixl", protocol="ucx-cma", gbps=8.0),
            dict(row, engine="nixl", protocol="ucx-sm", gbps=10.0),
            dict(row, engine="nixl-compat", protocol="kvflow-cma", gbps=9.0),
            dict(row, group="lat-local", point="4 KiB x1", engine="nixl", protocol="ucx-cma", latency_p50_us=6.0),
            dict(row, group="lat-local", point="4 KiB x1", engine="nixl", protocol="ucx-sm", latency_p50_us=5.0),
            dict(row, group="lat-local", point="4 KiB x1", engine="nixl-compat", protocol="kvflow-cma",
                 latency_p50_us=5.5)]
    compare.add_ratios(rows)
    assert (rows[2]["vs_best_alt"], rows[2]["best_alt"]) == (0.9, "nixl ucx-sm")
    assert (rows[5]["vs_best_alt"], rows[5]["best_alt"]) == (1.1, "nixl ucx-sm")


def test_qos_runs_the_modes_in_turn_and_pools_them():
    """kvflow-bench qos --repeat 2: fifo and qos twice each, in turn; each
    mode's figures pool its two runs (the stream's bytes are exactly what
    the two runs streamed), and the ratios are computed from them."""
    low = 1 << 20
    rows = results(bench("qos", "--protocol", "tcp", "--repeat", "2", "--rounds", "4", "--low-batches", "8",
                         "--low-size", str(low), "--high-entries", "4", "--high-entry", "4K",
                         "--interval", "1-2", "--cancel-size", str(4 * low), "--json", "--no-progress"))
    by = {r.get("mode", "ratios"): r for r in rows}
    assert set(by) == {"fifo", "qos", "ratios"}
    for mode in ("fifo", "qos"):
        r = by[mode]
        assert r["runs"] == 2 and len(r["stream_gbps_runs"]) == 2
        assert r["stream_bytes"] == 2 * 4 * 8 * low
        assert r["stream_gbps"] == pytest.approx(r["stream_bytes"] / r["seconds"] / 1e9, rel=1e-6)
        assert min(r["stream_gbps_runs"]) <= r["stream_gbps"] <= max(r["stream_gbps_runs"])
        assert 0 < r["short_p50_ms"] <= r["short_p99_ms"] <= r["short_max_ms"] and r["cancel_ms"] >= 0
    ratios = by["ratios"]["ratios"]
    assert ratios["stream_qos_over_fifo"] == pytest.approx(by["qos"]["stream_gbps"] / by["fifo"]["stream_gbps"])
    assert ratios["short_p99_fifo_over_qos"] == pytest.approx(by["fifo"]["short_p99_ms"] / by["qos"]["short_p99_ms"])
