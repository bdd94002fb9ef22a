"""kvflow-bench store, run as users run it (client processes, an embedded
or a standalone master): its JSON rows are checked against what it was
asked to move, and tools/compare.py's store rows against store_bench's
points."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 180


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1"}


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "kvflow.cli.bench", "store", *args], capture_output=True, text=True,
                       timeout=TIMEOUT, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL, check=False)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def rows(p: subprocess.CompletedProcess[str]) -> list[dict]:
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_two_clients_move_exactly_what_was_asked_and_every_byte_verifies():
    sizes, batch, rounds, clients = (64 << 10, 256 << 10), 8, 2, 2
    out = rows(bench("--size", "64K,256K", "--batch", str(batch), "--rounds", str(rounds), "--warmup", "0",
                     "--clients", str(clients), "--protocol", "tcp", "--json", "--no-progress"))
    assert [(r["op"], r["object_size"]) for r in out] == [(op, s) for s in sizes for op in ("put", "get", "exists")]
    for r in out:
        n = clients * batch * rounds
        assert (r["clients"], r["batch"], r["rounds"], r["calls"]) == (clients, batch, rounds, clients * rounds)
        assert r["objects"] == r["ok"] == n
        assert r["protocol"] == "tcp" and r["master"] == "embedded"
        assert 0 < r["latency_p50_us"] <= r["latency_p99_us"] and r["seconds"] > 0
        # one master round trip per batch call, whatever its size (put: allocate, commit)
        assert r["master_round_trips_per_call"] == {"put": 2, "get": 1, "exists": 1}[r["op"]]
        if r["op"] == "exists":
            assert r["bytes"] == 0 and r["gbps"] is None
            continue
        assert r["bytes"] == n * r["object_size"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-6)
        if r["op"] == "get":
            assert r["verified"] is True and r["bytes_verified"] == r["bytes"]


def test_a_standalone_master_and_a_plot(tmp_path):
    pytest.importorskip("matplotlib")
    master = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        line = master.stdout.readline()
        assert "ready" in line, line
        address = line.split()[-1]
        plot = tmp_path / "store.png"
        p = bench("--master", address, "--op", "get,exists", "--size", "4K,16K", "--batch", "4", "--rounds", "1",
                  "--warmup", "0", "--json", "--plot", str(plot))
        out = rows(p)
        assert [(r["op"], r["object_size"]) for r in out] == [("get", 4096), ("exists", 4096),
                                                               ("get", 16384), ("exists", 16384)]
        assert all(r["master"] == address and r["objects"] == r["ok"] == 4 for r in out)
        assert all(r["verified"] for r in out if r["op"] == "get")
        assert plot.stat().st_size > 10_000
        assert "kvflow-bench store: master " + address in p.stderr       # progress on stderr
    finally:
        master.terminate()
        master.wait(10)


def test_table_output_ends_with_the_metrics_summary():
    p = bench("--size", "4K", "--batch", "4", "--rounds", "1", "--warmup", "0")
    assert p.stdout.splitlines()[0].split()[:4] == ["op", "size", "batch", "clients"]
    assert len(p.stdout.splitlines()) == 4
    assert "metrics: master round trips: batch_exists 1 " in p.stderr


@pytest.mark.parametrize("args,message", [
    (("--segment-size", "0"), "--segment-size 0 needs --master"),
    (("--op", "put,scan"), "--op"),
])
def test_bad_options_are_refused_with_a_message(args, message):
    p = bench(*args, check=False)
    assert p.returncode == 2 and message in p.stderr


def _compare():
    sys.path.insert(0, str(ROOT / "tools"))
    import compare
    return compare


def test_compare_store_rows_are_ratios_against_mooncake_and_kvflows_own_transfers():
    compare = _compare()
    point = lambda op, size, gbps: {"op": op, "size": size, "batch": 64, "gbps": gbps,
                                    "seconds_p50": 64 * size / gbps / 1e9, "rounds": 5}
    runs = [{"system": "kvflow", "points": [point("put", 1 << 20, 4.0), point("get", 1 << 20, 3.0),
                                            point("raw_write", 1 << 20, 5.0), point("raw_read", 1 << 20, 4.0),
                                            point("memcpy", 1 << 20, 9.0),
                                            {"op": "batch_exists", "keys": 128, "p50_us": 60.0, "p99_us": 90.0},
                                            {"op": "put_from", "keys": 1, "p50_us": 200.0, "p99_us": 300.0}]},
            {"system": "mooncake", "points": [point("put", 1 << 20, 1.0), point("get", 1 << 20, 1.5),
                                              {"op": "batch_exists", "keys": 128, "p50_us": 120.0, "p99_us": 200.0}]},
            {"system": "kvflow", "points": [point("put", 1 << 20, 3.0)]}]        # a slower repeat: the best is kept
    rows = compare.store_rows_from(runs, "cmd")
    compare.add_ratios(rows)
    by = {(r["group"], r["point"], r["engine"]): r for r in rows}
    put = by[("store", "put 1 MiB x64", "kvflow")]
    assert put["gbps"] == 4.0 and put["runs"] == [4.0, 3.0]
    assert put["vs_best_alt"] == 4.0 and put["best_alt"] == "mooncake tcp"
    assert put["of_ceiling"] == 0.8 and put["ceiling"] == "kvflow-raw"
    get = by[("store", "get 1 MiB x64", "kvflow")]
    assert get["vs_best_alt"] == 2.0 and get["of_ceiling"] == 0.75
    exists = by[("store-exists", "128 keys", "kvflow")]
    assert exists["vs_best_alt"] == 0.5 and exists["latency_p50_us"] == 60.0
    assert [r["engine"] for r in rows if r["point"] == "put 1 MiB x64"] == ["kvflow", "mooncake", "kvflow-raw",
                                                                           "memcpy"]
    assert "put_from" not in {r["point"] for r in rows}
    assert "store" in compare.render(rows, markdown=True)


def test_compare_runs_the_store_rows_with_store_bench():
    p = subprocess.run([sys.executable, "tools/compare.py", "--groups", "store,store-exists", "--only",
                        "kvflow,mooncake,ceilings", "--store-sizes", "64K", "--store-rounds", "1", "--markdown"],
                       capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("| store")]
    kvflow_put = next(line for line in lines if "| put 64 KiB x64 | kvflow | tcp |" in line)
    assert "x kvflow-raw" in kvflow_put                  # of ceiling: kvflow's own tcp write
    assert any("| 128 keys | kvflow | tcp |" in line for line in lines)
    mooncake = [line for line in lines if "| mooncake |" in line]
    assert mooncake and all("not installed" in line or "error" not in line for line in mooncake)
    if not any("not installed" in line for line in mooncake):
        assert "x mooncake tcp" in kvflow_put
