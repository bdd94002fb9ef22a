"""tools/master_scale.py, run as its users run it (a master, a loader and
driver processes): its rows agree with what it ran, and the master's own
call count covers every call the drivers made."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

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
