"""tools/compare_rdma.py's bookkeeping (no device needed): best and median of
repeated runs, and the ratios of kvflow's rows to the ceiling and Mooncake."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import compare_rdma  # noqa: E402  (a script in tools/, stdlib only: never skipped)


def point(group, engine, config="", block=4096):
    p = {"group": group, "point": "4 KiB x64" if group == "bw" else "4 KiB x1", "engine": engine,
         "config": config, "env": {}, "cmd": [engine]}
    if group == "bw":
        p["block"] = block
    return p


def runs(metric, *values):
    return [{"status": "ok", metric: v} if v is not None else {"status": "error", "error": "boom"}
            for v in values]


def test_bw_rows_carry_best_and_median_and_both_ratios():
    rows = [
        compare_rdma.best_row(point("bw", "kvflow"), runs("gbps", 0.020, 0.027, 0.022)),
        compare_rdma.best_row(point("bw", "mooncake", "default"), runs("gbps", 0.010, 0.012, None)),
        compare_rdma.best_row(point("bw", "mooncake", "MC_WORKERS_PER_CTX=1"), runs("gbps", 0.030, 0.018, 0.023)),
        compare_rdma.best_row(point("bw", "ib_write_bw"), runs("gbps", 0.021, 0.024, 0.019)),
    ]
    kv = compare_rdma.add_derived(rows)[0]
    assert kv["gbps"] == 0.027 and kv["median"] == 0.022 and kv["runs"] == [0.020, 0.027, 0.022]
    assert kv["vs_ceiling"] == round(0.027 / 0.024, 3)
    assert kv["median_vs_ceiling"] == round(0.022 / 0.021, 3)
    # best/best against the one-worker config's lucky 0.030; median/median against its 0.023
    assert kv["vs_best_mooncake"] == round(0.027 / 0.030, 3)
    assert kv["median_vs_best_mooncake"] == round(0.022 / 0.023, 3)
    assert kv["best_mooncake"] == "MC_WORKERS_PER_CTX=1"
    cells = compare_rdma.cells(kv)
    assert "median 1.05x" in cells[-2] and "median 0.96x" in cells[-1]
    assert cells[compare_rdma.COLS.index("median")] == "0.0220"


def test_latency_median_is_compared_with_twice_ib_write_lat():
    rows = [
        compare_rdma.best_row(point("lat", "kvflow"), runs("latency_p50_us", 400.0, 380.0, 420.0)),
        compare_rdma.best_row(point("lat", "mooncake", "MC_WORKERS_PER_CTX=1"), runs("latency_p50_us", 450.0, 390.0, 500.0)),
        compare_rdma.best_row(point("lat", "ib_write_lat"), runs("latency_p50_us", 180.0, 170.0, 200.0)),
    ]
    out = compare_rdma.add_derived(rows)
    twice = next(r for r in out if r["engine"] == "2x ib_write_lat")
    assert twice["latency_p50_us"] == 340.0 and twice["median"] == 360.0
    kv = out[0]
    assert kv["latency_p50_us"] == 380.0 and kv["median"] == 400.0
    assert kv["vs_ceiling"] == round(380 / 340, 3) and kv["median_vs_ceiling"] == round(400 / 360, 3)
    assert kv["vs_best_mooncake"] == round(380 / 390, 3)
    assert kv["median_vs_best_mooncake"] == round(400 / 450, 3)


def test_single_run_has_no_median_columns():
    rows = [compare_rdma.best_row(point("bw", "kvflow"), runs("gbps", 0.02)),
            compare_rdma.best_row(point("bw", "ib_write_bw"), runs("gbps", 0.02))]
    kv = compare_rdma.add_derived(rows)[0]
    assert "median" not in kv and "median_vs_ceiling" not in kv
    assert "median" not in compare_rdma.cells(kv)[-2]
