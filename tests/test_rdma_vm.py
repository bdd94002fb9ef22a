"""The rdma-marked tests, run inside the Soft-RoCE VM on a host without RDMA.

A host with an RDMA device runs the ``rdma`` tests natively, and inside the VM
(KVFLOW_IN_VM) this module has nothing to do: both skip. Otherwise this boots
``tools/rdma_vm.py`` with two rxe devices over dummy netdevs (rxe0, rxe1: one
rail and two), runs ``pytest -m rdma tests`` there, and requires that it
passed, that at least one test ran, and that none was skipped: an rdma test
skipped inside the VM means the VM did not give it what it needs.

When the VM cannot be set up or does not boot, the test skips with the reason,
except under CI (CI=true), where it fails.

KVFLOW_VM_TIMEOUT (seconds, default 2400) bounds the VM run.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "tools", "rdma_vm.py")
MARK = "rdma or vm"  # the markers whose tests run in the VM
TAIL_CHARS = 8000


def _harness():
    spec = importlib.util.spec_from_file_location("kvflow_rdma_vm", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses needs the module registered
    spec.loader.exec_module(mod)
    return mod


def _host_rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the RDMA VM is unavailable under CI: {why}", pytrace=False)
    pytest.skip(f"the RDMA VM is unavailable: {why}")


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no output)"
    return text[-TAIL_CHARS:]


def _junit(path: str) -> tuple[list[str], list[tuple[str, str]], list[str], list[str]]:
    """(passed, skipped [(test, reason)], failed/errored, xfailed) test ids from a junit xml."""
    passed, skipped, failed, xfailed = [], [], [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            failed.append(name)
        elif skip is not None and skip.get("type") == "pytest.xfail":
            xfailed.append(name)
        elif skip is not None:
            skipped.append((name, skip.get("message") or (skip.text or "").strip()))
        else:
            passed.append(name)
    return passed, skipped, failed, xfailed


def test_rdma_tests_in_vm(tmp_path):
    if os.environ.get("KVFLOW_IN_VM"):
        pytest.skip("already inside the RDMA VM")
    devs = _host_rdma_devices()
    if devs:
        pytest.skip(f"this host has RDMA devices ({', '.join(devs)}): the rdma tests run natively")

    vm = _harness()
    why = vm.ensure_setup()
    if why:
        _unavailable(why)

    timeout = float(os.environ.get("KVFLOW_VM_TIMEOUT", "2400"))
    # conftest's per-test watchdog (KVFLOW_TEST_WATCHDOG_S) is far shorter than a VM boot
    # plus the rdma tests under emulation: re-arm it past the VM's own timeout.
    faulthandler.dump_traceback_later(timeout + 300, exit=True)

    xml_path = os.path.join(tmp_path, "rdma.xml")
    log_path = os.path.join(tmp_path, "vm.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", MARK, "-rs", f"--junitxml={xml_path}", "tests"]
    # Compile on the host what the guest's pytest will import (into the harness's byte-code
    # cache, not next to the sources): under emulation that would take the guest minutes.
    try:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-m", MARK, "-p", "no:cacheprovider", "tests"],
                       cwd=ROOT, env=vm.pycache_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        pass  # only a warm-up
    # Everything is slower under TCG: give each test in the VM more than the host default.
    env = {"KVFLOW_TEST_WATCHDOG_S": os.environ.get("KVFLOW_VM_TEST_WATCHDOG_S", "600")}
    with open(log_path, "w") as out:
        res = vm.run_vm(cmd, devices=2, netdev="dummy", rwdir=str(tmp_path), timeout=timeout,
                        cwd=ROOT, env=env, output=out)
    tail = _tail(log_path)
    print(tail)  # shown with the failure report

    if res.rc == vm.TIMED_OUT:
        pytest.fail(f"the VM run {res.reason}\n--- VM output (tail) ---\n{tail}", pytrace=False)
    if res.reason is not None and res.ready_s is None:  # never got as far as running the command
        _unavailable(f"{res.reason}\n--- VM output (tail) ---\n{tail}")
    if res.reason is not None:
        pytest.fail(f"{res.reason}\n--- VM output (tail) ---\n{tail}", pytrace=False)
    if not os.path.exists(xml_path):
        pytest.fail(f"pytest in the VM exited {res.rc} and wrote no junit xml\n"
                    f"--- VM output (tail) ---\n{tail}", pytrace=False)

    passed, skipped, failed, xfailed = _junit(xml_path)
    problems = []
    if res.rc != 0:
        problems.append(f"pytest -m {MARK} in the VM exited {res.rc}"
                        + (" (no tests collected)" if res.rc == 5 else "")
                        + (f"; failed: {', '.join(failed)}" if failed else ""))
    if not passed and not failed:
        problems.append(f"no test marked {MARK!r} ran in the VM")
    if skipped:
        problems.append(f"{len(skipped)} {MARK} test(s) skipped inside the VM, which must give them RDMA and netem:\n"
                        + "\n".join(f"    {name}: {reason}" for name, reason in skipped))
    if problems:
        pytest.fail("\n".join(problems) + f"\n--- VM output (tail) ---\n{tail}", pytrace=False)
    print(f"{len(passed)} {MARK} test(s) passed in the VM ({len(xfailed)} xfailed); "
          f"rxe ready after {res.ready_s or 0:.0f} s, total {res.total_s:.0f} s")
