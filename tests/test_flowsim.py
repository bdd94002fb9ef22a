"""tools/flowsim.py: the flow-level model of the rail-optimised cluster
(issue 21). Its physics on cases whose answer is known in closed form, its
bookkeeping (every byte delivered, the spine's bytes), and its small case
against the emulation's measured medians."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("flowsim", os.path.join(ROOT, "tools", "flowsim.py"))
flowsim = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
sys.modules["flowsim"] = flowsim          # its dataclasses look their module up
_spec.loader.exec_module(flowsim)

MB = 1e6
NIC = 25 * MB                      # bytes/s


def small_cluster(rails: int = 4, spine: float = 2 * NIC, interconnect: float = 4e9) -> "flowsim.Cluster":
    return flowsim.Cluster(2, rails, NIC, interconnect, spine)


def test_one_flow_takes_its_bytes_over_the_link_rate() -> None:
    c = small_cluster()
    f = flowsim.Flow((0, 1), (1, 1), 10 << 20)
    res = flowsim.simulate(c, [f], "naive", window=256 << 10, relay_window=16 << 20)
    assert res["done"][0] == pytest.approx((10 << 20) / NIC, abs=2 * res["dt"])   # a step per hop
    assert res["bytes_delivered"] == pytest.approx(10 << 20, abs=1)
    assert res["spine_bytes"] == 0                       # rail-aligned: never on the spine
    assert res["decode_queue_peak_bytes"] < 1           # one flow at its own rate queues nothing


def test_incast_shares_the_decode_port_and_its_queue_is_bounded_by_the_windows() -> None:
    c = small_cluster()
    size, window = 4 << 20, 512 << 10
    flows = [flowsim.Flow((0, s), (1, 0), size) for s in (0, 2, 3)]
    res = flowsim.simulate(c, flows, "naive", window=window, relay_window=16 << 20)
    assert np.max(res["done"]) == pytest.approx(3 * size / NIC, abs=2 * res["dt"])
    assert 1.5 * window < res["decode_queue_peak_bytes"] <= 3 * window
    assert res["spine_bytes"] == pytest.approx(2 * size, rel=1e-6)     # two of the three change rail


def test_receive_relay_brings_an_incast_in_over_the_neighbours_nics() -> None:
    c = small_cluster()
    size = 4 << 20
    flows = [flowsim.Flow((0, s), (1, 0), size) for s in (0, 2, 3)]
    res = flowsim.simulate(c, flows, "recv_relay", window=512 << 10, relay_window=16 << 20)
    assert np.max(res["done"]) == pytest.approx(size / NIC, abs=4 * res["dt"])   # three NICs at once
    assert res["spine_bytes"] == 0
    assert res["decode_queue_peak_bytes"] < 1
    assert [f.path[f.relay_at] for f in flows[1:]] == [c.out[1][2], c.out[1][3]]   # the members on their rails


def test_send_relay_funnels_through_the_member_on_the_destinations_rail() -> None:
    c = small_cluster()
    size = 4 << 20
    flows = [flowsim.Flow((0, s), (1, 0), size) for s in (0, 2, 3)]
    res = flowsim.simulate(c, flows, "send_relay", window=512 << 10, relay_window=16 << 20)
    assert np.max(res["done"]) == pytest.approx(3 * size / NIC, abs=4 * res["dt"])   # one NIC into decode rank 0
    assert res["spine_bytes"] == 0
    assert res["decode_queue_peak_bytes"] < 1          # the queue sits in the member's slots, not the fabric
    assert all(c.tx[0][0] in f.path for f in flows)


def test_staggered_chains_run_one_flow_after_another() -> None:
    flows = flowsim.small_flows("pp-tp", "staggered", rails=4, layers=8, shard=256 << 10)
    res = flowsim.simulate(small_cluster(), flows, "staggered", window=256 << 10, relay_window=16 << 20)
    chained = [(i, f.after) for i, f in enumerate(flows) if f.after is not None]
    assert len(chained) == 12
    for i, prev in chained:
        assert res["began"][i] >= res["done"][prev]


def test_small_case_keeps_every_byte_and_relays_keep_off_the_spine() -> None:
    rows = {s: flowsim.run_small(s, "pp-tp", shard_kib=512) for s in flowsim.STRATEGIES}
    for r in rows.values():
        assert r["bytes_delivered"] == pytest.approx(r["bytes_sent"], abs=r["flows"])
    cross = rows["naive"]["bytes_sent"] * 12 / 16
    assert rows["naive"]["spine_bytes"] == pytest.approx(cross, rel=1e-6)
    assert rows["send_relay"]["spine_bytes"] == rows["recv_relay"]["spine_bytes"] == 0


def test_small_case_is_close_to_the_emulations_medians() -> None:
    """The calibration the docs report: the p99 of naive pp-tp and of the
    3 -> 1 incast (naive and both relays) within 20% of what the emulated
    cluster measured (docs/relay_emulation.json)."""
    rows = flowsim.small_table((2.0,))
    checked = 0
    for r in rows:
        m = r["emulated"]
        if m and (r["pattern"], r["strategy"]) in {("pp-tp", "naive"), ("incast", "naive"),
                                                   ("incast", "send_relay"), ("incast", "recv_relay")}:
            assert r["completion_p99_s"] == pytest.approx(m["completion_p99_s"], rel=0.2), r
            checked += 1
    assert checked == 4


def test_cluster_case_runs_the_trace_and_reports_requests() -> None:
    if not os.path.exists(flowsim.TRACE):
        pytest.skip("the Mooncake trace is not beside the checkout")
    out = {s: flowsim.run_cluster(s, 0.5, nodes=4, requests=8) for s in ("naive", "send_relay")}
    for r in out.values():
        assert r["requests"] == 8 and r["flows"] == 8 * 64
        assert r["bytes_delivered"] == pytest.approx(r["bytes_sent"], abs=r["flows"])
        assert len(r["request_latencies_s"]) == 8 and r["request_p99_s"] >= r["request_p50_s"] > 0
    assert out["naive"]["spine_bytes"] == pytest.approx(out["naive"]["bytes_sent"] * 7 / 8, rel=1e-3)
    assert out["send_relay"]["spine_bytes"] == 0


def test_command_line_prints_one_json_line() -> None:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "flowsim.py"), "--case", "small",
                        "--strategy", "recv_relay", "--pattern", "incast", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("strategy", "bytes_sent", "bytes_delivered", "spine_bytes", "completion_p50_s",
                "completion_p99_s", "decode_queue_peak_bytes"):
        assert key in res
    assert res["strategy"] == "recv_relay" and res["spine_bytes"] == 0
