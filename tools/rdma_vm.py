#!/usr/bin/env python3
"""Run a command inside a throw-away VM that has real RDMA verbs (Soft-RoCE).

The host kernel need not have RDMA: the harness boots a stock Debian kernel
(``linux-image-<arch>``, unpacked into a cache directory) under QEMU with
virtme-ng, which shares the host's root filesystem READ-ONLY into the guest.
In the guest it loads ``rdma_rxe``, creates the rxe devices, waits until every
port is ACTIVE and has its IPv4-mapped RoCE v2 GID, then runs the command in
the same working directory, as root, and exits with the command's status.

    python3 tools/rdma_vm.py --setup                      # install + fetch kernel (idempotent)
    python3 tools/rdma_vm.py -- ibv_devinfo -d rxe0       # one rxe0 over lo
    python3 tools/rdma_vm.py --netdev dummy --devices 2 --rwdir out -- \\
        python3 -m pytest -q -m rdma tests                # rxe0, rxe1: two rails

Devices: ``--netdev lo`` (default) gives rxe0 over lo (GID index 1 is
::ffff:127.0.0.1, RoCE v2). ``--netdev dummy --devices N`` gives N dummy
netdevs kvfd0..kvfd<N-1> with 198.18.<i>.1/24, and rxe<i> on each; every rxe
device loops back to itself, so two engines in the VM can pair rxe0<->rxe0
and rxe1<->rxe1 as two rails.

In the guest: KVFLOW_IN_VM=1, KVFLOW_KEEPALIVE=60, KVFLOW_RDMA_DEVICES=rxe0[,rxe1...], PYTHONPATH,
PYTEST_ADDOPTS="-p no:cacheprovider" and PYTHONPYCACHEPREFIX (byte code goes to
a writable cache kept in KVFLOW_VM_DIR/pycache; with KVFLOW_VM_PYCACHE=0,
PYTHONDONTWRITEBYTECODE=1 instead), plus CI, HYPOTHESIS_* and the other
KVFLOW_* variables of the caller. The root filesystem is read-only there;
/tmp is a guest-private overlay; host paths the guest must write go in
``--rwdir``. ``python3`` in the guest's PATH is the harness's interpreter (its
directory is put first); the interpreter's prefix and the working directory are
re-mounted from a cached 9p export (much faster lookups, still read-only).

Exit status: the command's; 124 when --timeout expired (the VM is killed);
97 when the harness could not set up, the VM did not boot, or rxe setup failed
(the reason is printed as "kvflow-vm: ...").

Environment: KVFLOW_VM_DIR (cache directory, default /opt/kvflow-vm; must not
be under /tmp or /var/cache, which the guest mounts over), KVFLOW_VM_KVM
(auto|on|off, default auto: KVM when a one-time probe boot succeeded, else TCG),
KVFLOW_VM_PYCACHE (see above).

Stdlib only; also importable: ``ensure_setup()``, ``run_vm()``, ``run_in_vm()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
if TOOLS not in sys.path:       # vmlib beside this script (also when loaded by file path, as tests do)
    sys.path.insert(0, TOOLS)

from vmlib.hostsetup import _kill_group, _vng_env, ensure_kernel, ensure_setup, find_vng, log, use_kvm  # noqa: E402
from vmlib.guest import (  # noqa: E402
    HOST_TAG, PYC_TAG, UDEV_BLACKLIST, _cached_paths, _guest_env, _guest_script, pycache_dir)
# importable from here, as the docstring says (tests/test_rdma_vm.py uses some)
from vmlib.guest import pycache_env  # noqa: E402,F401

SETUP_FAILED = 97  # could not set up / VM did not boot / rxe setup failed
TIMED_OUT = 124


# ------------------------------------------------------------------ running


@dataclasses.dataclass
class VMResult:
    rc: int  # the command's exit status, or SETUP_FAILED / TIMED_OUT
    reason: str | None = None  # why rc is SETUP_FAILED or TIMED_OUT
    boot_s: float | None = None  # VM start -> guest script started
    ready_s: float | None = None  # VM start -> rxe devices ACTIVE
    total_s: float = 0.0
    kvm: bool = False
    tail: str = ""  # the last 64 KiB of the guest's (and vng's) output

    @property
    def ran(self) -> bool:
        """The command itself ran (rc is its status)."""
        return self.reason is None


class _Tail:
    def __init__(self, limit: int = 64 << 10):
        self.buf = bytearray()
        self.limit = limit

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > 2 * self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def text(self) -> str:
        return bytes(self.buf[-self.limit:]).decode(errors="replace")


def _pump(src, dest, tail: _Tail) -> None:
    """Copy the VM's output to dest (a text or binary file object) as it comes, keep a tail."""
    fd = None
    try:
        fd = dest.fileno()
    except (AttributeError, OSError, ValueError):
        pass
    while True:
        data = src.read1(65536) if hasattr(src, "read1") else src.read(65536)
        if not data:
            break
        tail.add(data)
        try:
            if fd is not None:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            else:
                dest.write(data.decode(errors="replace"))
                dest.flush()
        except OSError:
            pass


def run_vm(cmd: list[str], *, devices: int = 1, netdev: str = "lo", rwdir=None, timeout: float = 3600,
           cpus: int = 2, memory: str = "4G", cwd: str | None = None, env: dict[str, str] | None = None,
           output=None, verbose: bool = False, quiet: bool = False, fast_fs: bool = True,
           pycache: bool | None = None) -> VMResult:
    """Boot the VM, set up rxe, run ``cmd`` in ``cwd`` (default: this process's). ``rwdir``: a path
    or a list of host paths the guest may write (created if missing). ``output``: a file object
    (with a fileno) that gets the guest's stdout and stderr, default: inherited."""
    t0 = time.monotonic()
    if pycache is None:
        pycache = fast_fs and os.environ.get("KVFLOW_VM_PYCACHE", "1") != "0"
    msgs = output if output is not None else sys.stderr

    def say(m):
        if not quiet:
            log(m, file=msgs)

    if not cmd:
        return VMResult(2, "no command given", total_s=0.0)
    if netdev not in ("lo", "dummy"):
        return VMResult(2, f"--netdev must be lo or dummy, not {netdev!r}")
    if devices < 1 or (netdev == "lo" and devices != 1):
        return VMResult(2, f"--devices {devices}: lo gives exactly one device (use --netdev dummy for more)")
    why = ensure_setup(kvm_probe=False)
    if why:
        say(f"cannot set up: {why}")
        return VMResult(SETUP_FAILED, f"cannot set up: {why}", total_s=time.monotonic() - t0)
    kernel, _ = ensure_kernel()
    vng = find_vng()
    kvm = use_kvm(kernel, vng)
    cwd = os.path.abspath(cwd or os.getcwd())
    rwdirs = [rwdir] if isinstance(rwdir, (str, os.PathLike)) else list(rwdir or [])
    rwdirs = [os.path.abspath(os.fspath(p)) for p in rwdirs]
    for p in rwdirs:
        os.makedirs(p, exist_ok=True)
    ctl = tempfile.mkdtemp(prefix="kvflow-vm-")
    try:
        script = os.path.join(ctl, "guest.sh")
        with open(script, "w") as f:
            f.write(_guest_script(ctl=ctl, cmd=list(cmd), cwd=cwd, env=_guest_env(devices, env, pycache=pycache),
                                  devices=devices, netdev=netdev, fast_fs=fast_fs,
                                  cached=_cached_paths(cwd) if fast_fs else []))
        vcmd = [vng, "-r", kernel.image, "--cpus", str(cpus), "--memory", str(memory),
                f"--rwdir={ctl}", *[f"--rwdir={p}" for p in rwdirs],
                "--append", "modprobe.blacklist=" + ",".join(UDEV_BLACKLIST), "--exec", f"sh {shlex.quote(script)}"]
        if fast_fs:  # must stay last: vng appends --qemu-opts at the end of qemu's command line
            os.makedirs(pycache_dir(), exist_ok=True)
            vcmd.append(f"--qemu-opts=-virtfs local,path=/,mount_tag={HOST_TAG},security_model=none,"
                        f"readonly=on,multidevs=remap -virtfs local,path={pycache_dir()},mount_tag={PYC_TAG},"
                        "security_model=none")
        if not kvm:
            vcmd.insert(1, "--disable-kvm")
        if verbose:
            vcmd.insert(1, "--verbose")
        say(f"booting {os.path.basename(kernel.image)} ({'KVM' if kvm else 'TCG, no KVM'}, {cpus} cpus, "
            f"{memory}), {devices} rxe device(s) over {netdev}")
        # The guest's output comes back through a pipe that we copy out: qemu reopens
        # /proc/self/fd/1 and 2 as files, which on a regular file restarts at offset 0
        # and overwrites what was written before.
        dest = output if output is not None else sys.stdout
        dest.flush()
        tail = _Tail()
        proc = subprocess.Popen(vcmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=_vng_env(vng), start_new_session=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, dest, tail), daemon=True)
        pump.start()
        timed_out = False
        try:
            vrc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            vrc = proc.returncode
        except BaseException:  # KeyboardInterrupt: do not leave a qemu behind
            _kill_group(proc)
            raise
        finally:
            pump.join(10)
        res = VMResult(rc=0, kvm=kvm, total_s=time.monotonic() - t0, tail=tail.text())

        def stamp(name):
            try:
                return os.stat(os.path.join(ctl, name)).st_mtime
            except OSError:
                return None

        wall0 = time.time() - (time.monotonic() - t0)
        s, r = stamp("started"), stamp("ready")
        res.boot_s = s - wall0 if s else None
        res.ready_s = r - wall0 if r else None
        rc_file = os.path.join(ctl, "rc")
        if timed_out:
            res.rc, res.reason = TIMED_OUT, f"timed out after {timeout:g} s; VM killed"
        elif os.path.exists(rc_file):
            with open(rc_file) as f:
                res.rc = int(f.read().strip() or SETUP_FAILED)
        elif os.path.exists(os.path.join(ctl, "setup_error")):
            with open(os.path.join(ctl, "setup_error")) as f:
                res.rc, res.reason = SETUP_FAILED, "guest setup failed: " + f.read().strip()
        elif s is None:
            res.rc, res.reason = SETUP_FAILED, f"the VM did not boot (vng exited {vrc} before the guest ran anything)"
        else:
            res.rc, res.reason = SETUP_FAILED, (f"the guest died while running the command (vng exited {vrc}, "
                                                "no exit status written)")
        timing = ", ".join(x for x in (
            f"guest up {res.boot_s:.1f} s" if res.boot_s is not None else "",
            f"rxe ready {res.ready_s:.1f} s" if res.ready_s is not None else "",
            f"total {res.total_s:.1f} s") if x)
        if res.reason:
            say(f"{res.reason} ({timing})")
        else:
            say(f"command exited {res.rc} ({timing})")
        return res
    finally:
        shutil.rmtree(ctl, ignore_errors=True)


def run_in_vm(cmd: list[str], devices: int = 1, netdev: str = "lo", rwdir=None, timeout: float = 3600,
              **kw) -> int:
    """run_vm(...).rc: the command's exit status, 124 on timeout, 97 when the VM could not run it."""
    return run_vm(cmd, devices=devices, netdev=netdev, rwdir=rwdir, timeout=timeout, **kw).rc


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rdma_vm.py",
        description="Run a command in a VM with Soft-RoCE (rdma_rxe) devices.",
        epilog="example: python3 tools/rdma_vm.py --netdev dummy --devices 2 -- "
               "python3 -m pytest -q -m rdma tests")
    ap.add_argument("--setup", action="store_true",
                    help="install the apt/pip packages when missing and fetch the guest kernel, then exit "
                         "(a command does this first anyway)")
    ap.add_argument("--devices", type=int, default=1, help="number of rxe devices (default 1; >1 needs --netdev dummy)")
    ap.add_argument("--netdev", choices=("lo", "dummy"), default="lo",
                    help="lo: rxe0 over lo; dummy: kvfd<i> (198.18.<i>.1/24) with rxe<i> on each")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--memory", default="4G")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds; the VM is killed and 124 returned past it")
    ap.add_argument("--cwd", default=None, help="guest working directory (default: the current one)")
    ap.add_argument("--rwdir", action="append", default=[], help="host directory the guest may write (repeatable)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra guest environment")
    ap.add_argument("--verbose", action="store_true", help="show the guest kernel's console")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.setup and not cmd:
        t0 = time.monotonic()
        why = ensure_setup()
        if why:
            log(f"cannot set up: {why}")
            return SETUP_FAILED
        k, _ = ensure_kernel()
        log(f"ready: kernel {k.version} in {os.path.dirname(os.path.dirname(k.image))}, vng {find_vng()}, "
            f"{'KVM' if use_kvm(k, find_vng(), probe=False) else 'TCG'} ({time.monotonic() - t0:.1f} s)")
        return 0
    if not cmd:
        ap.error("no command given (python3 tools/rdma_vm.py [options] -- CMD ARGS...)")
    if args.netdev == "lo" and args.devices != 1:
        ap.error("--netdev lo gives exactly one device; use --netdev dummy for --devices > 1")
    if args.devices < 1:
        ap.error("--devices must be >= 1")
    extra = {}
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            ap.error(f"--env {kv!r}: expected KEY=VALUE")
        extra[k] = v
    res = run_vm(cmd, devices=args.devices, netdev=args.netdev, rwdir=args.rwdir, timeout=args.timeout,
                 cpus=args.cpus, memory=args.memory, cwd=args.cwd, env=extra, verbose=args.verbose)
    return res.rc


if __name__ == "__main__":
    sys.exit(main())
