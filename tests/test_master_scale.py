"""tools/master_scale.py, run as its users run it (a master, a loader and
driver processes): its rows agree with what it ran, and the master's own
call count covers every call the drivers made."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_master_scale_tool_measures_what_it_ran(tmp_path):
    out = tmp_path / "scale.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "master_scale.py"), "--objects", "0,3000",
                        "--clients", "1,2", "--seconds", "0.5", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    points = data["points"]
    assert [(q["objects"], q["op"], q["clients"]) for q in points] == [
        (n, op, k) for n in (0, 3000) for op in ("exists", "put") for k in (1, 2)]
    for q in points:
        assert q["calls_per_s"] > 0
        # every driver call reached the master (beside heartbeats and registrations)
        assert q["master_calls"] >= q["calls_per_s"] * 0.5 * 0.9
        per_call = 128 if q["op"] == "exists" else 16 / 3
        assert abs(q["keys_per_s"] / q["calls_per_s"] - per_call) < 1e-6
    index = {r["objects"]: r for r in data["index"]}
    assert index[3000]["bytes_per_object"] > 0 and index[3000]["load_puts_per_s"] > 0
    assert "| 3,000 | exists | 2 |" in p.stdout


def test_the_recovery_mode_finds_every_object_again(tmp_path):
    """--recovery with a real etcd: after each takeover (a restarted master,
    a standby) every loaded object is found again, with its bytes."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian: etcd-server)")
    out = tmp_path / "recovery.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "master_scale.py"), "--recovery", "--objects",
                        "300,2500", "--leader-ttl", "1", "--sample", "400", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["objects"], r["takeover"]) for r in data["recovery"]] == [
        (n, how) for n in (300, 2500) for how in ("restart", "standby")]
    for r in data["recovery"]:
        assert r["recovered"] == r["objects"] and r["missing"] == 0
        assert r["wrong"] == 0 and r["sample"] == min(400, r["objects"])
        # (the reader may get before this process reads the ready line: no order between them)
        assert 0 < r["recover_s"] < r["ready_s"] and 0 < r["first_get_s"] <= r["all_exist_s"] <= r["sample_read_s"]
    assert [r["objects"] for r in data["load"]] == [300, 2500]
    assert all(r["etcd_txns_per_s"] > 0 for r in data["load"])
    assert "| 2,500 | standby |" in p.stdout
