#!/usr/bin/env bash
# The GPU check: one command, on a machine with a CUDA GPU (an H200 lent by
# the device tool; docs/gpu.md), at most about 9 minutes. Builds
# kvflow in place (with its CUDA module), runs the CUDA, staging and pool
# (put_from/get_into of CUDA tensors) tests and
# the PD example with its model and KV pools on the GPU,
# then tools/gpu_bench.py, tools/gpu_put.py and tools/gpu_relay.py, and writes into OUTDIR (default $OUT, else
# ./gpu-check): gpu_check.json (the bench), tests.txt, gpu_check.md (a
# markdown table). Carried wheels in .whl/ (Mooncake's, NIXL's) are
# installed first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-gpu-check}}"
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
{
  echo "# kvflow GPU check, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
  $PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.is_available())" 2>&1
} > "$OUTDIR/env.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUTDIR/env.txt" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# build: the native core and the fatbin (KVFLOW_CUDA=on: fail without nvcc)
KVFLOW_CUDA=on timeout 120 $PY setup.py -q build_ext --inplace > "$OUTDIR/build.txt" 2>&1
echo "build rc=$?" >> "$OUTDIR/env.txt"
$PY -c "import kvflow, kvflow.cuda; print(kvflow.features, kvflow.cuda.available(), kvflow.cuda.reason())" \
  >> "$OUTDIR/env.txt" 2>&1
timeout 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_staging.py tests/test_store_cuda.py \
  "tests/test_pd_e2e.py::test_disaggregated_generation_matches_single_process" > "$OUTDIR/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUTDIR/env.txt"
timeout 180 $PY tools/gpu_bench.py --blocks 64,1024,16384 --rounds 5 --anchor-seconds 1 \
  --json "$OUTDIR/gpu_check.json" > "$OUTDIR/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUTDIR/env.txt"
# GPU-initiated puts, proxy mode: a kernel puts its layer from the device (p50 latency)
timeout 60 $PY tools/gpu_put.py --json > "$OUTDIR/gpu_put.json" 2>"$OUTDIR/gpu_put.err"
echo "gpu_put rc=$?" >> "$OUTDIR/env.txt"
# the relay's copy-engine hop behind the network: 64 MiB direct and relayed through device lanes
timeout 60 $PY tools/gpu_relay.py --json > "$OUTDIR/gpu_relay.json" 2>"$OUTDIR/gpu_relay.err"
echo "gpu_relay rc=$?" >> "$OUTDIR/env.txt"
$PY - "$OUTDIR" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
lines = ["# kvflow GPU check", "", open(os.path.join(out, "env.txt")).read(), ""]
tail = open(os.path.join(out, "tests.txt")).read().strip().splitlines()[-1:]
lines += ["tests: " + (tail[0] if tail else "(none)"), ""]
try:
    res = json.load(open(os.path.join(out, "gpu_check.json")))
    keys = [k for k in res["rows"][0] if k != "block"]
    lines += ["| block | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['block'] >> 10} KiB | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
except (OSError, ValueError, KeyError, IndexError) as e:
    lines.append(f"bench: no results ({e})")
try:
    lines += ["", "gpu_put: " + open(os.path.join(out, "gpu_put.json")).read().strip()]
except OSError as e:
    lines.append(f"gpu_put: no results ({e})")
try:
    lines += ["", "gpu_relay: " + open(os.path.join(out, "gpu_relay.json")).read().strip()]
except OSError as e:
    lines.append(f"gpu_relay: no results ({e})")
open(os.path.join(out, "gpu_check.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
