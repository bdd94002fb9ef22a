"""kvflow's GPU paths under the CUDA driver stand-in (marked cuda_standin).

The stand-in (tests/cuda_standin/*.c, one library) is built here with cc
against the CUDA toolkit's cuda.h, and tests/cuda_standin/cases.py (with
store_cases.py, the pool's GPU callers) runs once, in a pytest of its own
whose processes load it as libcuda.so.1 (this process never does: the
rest of the suite checks kvflow where CUDA is not usable). Each case is
then reported here as one test. A test double, never a GPU result:
tools/gpu_check.sh on a GPU is the acceptance, and docs/gpu.md says which
paths have run on one (none yet).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from _batches import TIME_SCALE
from _cuda_standin import CASE_FILES, ROOT, build, env

pytestmark = pytest.mark.cuda_standin

# the whole run happens in the first case's setup: under conftest's
# per-test watchdog (150 s, scaled), so that this timeout says what hung
RUN_TIMEOUT = 130 * TIME_SCALE


def _cases() -> list[str]:
    return [n.name for f in CASE_FILES for n in ast.parse(open(f).read()).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")]


def _missing() -> str | None:
    """What the stand-in's run needs and this machine lacks: cc and the
    CUDA toolkit's headers (to build it), cuda-bindings (what kvflow drives
    the driver with), the fatbin (the kernels' names)."""
    import importlib.util
    import shutil
    from _cuda_standin import cuda_include
    from kvflow._cuda import built
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler"
    if cuda_include() is None:
        return "no CUDA toolkit headers (cuda.h, cudaTypedefs.h)"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed"
    if not built():
        return "kvflow was built without its CUDA module (no nvcc at build time)"
    return None


@pytest.fixture(scope="module")
def standin_results(tmp_path_factory) -> dict[str, list[tuple[str, str, str]]]:
    """{case: [(test id, outcome, text)]} from one run of cases.py under the
    stand-in."""
    missing = _missing()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the CUDA stand-in cannot run under CI: {missing} (.ci/setup installs them)", pytrace=False)
        pytest.skip(f"the CUDA stand-in cannot run here: {missing}")
    d = str(tmp_path_factory.mktemp("cuda-standin"))
    build(d)
    xml = os.path.join(d, "cases.xml")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                          f"--junitxml={xml}", *CASE_FILES], cwd=ROOT, env=env(d), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    print(f"cases under the stand-in: {time.monotonic() - t0:.1f} s\n{out.stdout[-3000:]}")
    if not os.path.exists(xml):
        pytest.fail(f"the stand-in's pytest wrote no results (rc {out.returncode}):\n{out.stdout[-4000:]}\n"
                    f"{out.stderr[-4000:]}")
    results: dict[str, list[tuple[str, str, str]]] = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = tc.get("name", "")
        outcome, text = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                text += (child.get("message") or "") + "\n" + (child.text or "")
        results.setdefault(name.split("[")[0], []).append((name, outcome, text))
    return results


@pytest.mark.parametrize("case", _cases())
def test_under_the_cuda_standin(standin_results, case):
    runs = standin_results.get(case)
    assert runs, f"{case} did not run under the stand-in"
    bad = [f"{name}: {outcome}\n{text[-3000:]}" for name, outcome, text in runs if outcome != "passed"]
    assert not bad, "\n\n".join(bad)
