"""What the RDMA VM needs on the host, set up once: apt and pip packages,
the guest kernel (a stock Debian one, unpacked into the cache directory) and
whether KVM works."""
from __future__ import annotations

import dataclasses
import fcntl
import glob
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

APT_PACKAGES = (
    "qemu-system-x86",
    "kmod",
    "busybox-static",
    "rdma-core",
    "ibverbs-providers",  # librxe, the Soft-RoCE userspace provider
    "ibverbs-utils",
    "perftest",
    "libibverbs-dev",
    "python3-pyverbs",
    "iproute2",
    "file",  # virtme-ng reads the kernel version with `file` (or `strings`)
)
PIP_PACKAGES = ("virtme-ng",)

DEFAULT_VM_DIR = "/opt/kvflow-vm"
# Mounted over (tmpfs / overlay) in the guest: a kernel cached there is not
# visible at the same path in the guest, so its modules symlink breaks.
_GUEST_MASKED = ("/tmp", "/var/cache", "/var/tmp", "/var/log", "/var/lib/apt", "/run", "/lib/modules",
                 "/usr/lib/modules")

def log(msg: str, file=None) -> None:
    print(f"kvflow-vm: {msg}", file=file or sys.stderr, flush=True)


# ------------------------------------------------------------------ setup


def vm_dir() -> str:
    return os.path.abspath(os.environ.get("KVFLOW_VM_DIR") or DEFAULT_VM_DIR)


def _sudo() -> list[str] | None:
    """Prefix for commands that need root: [] as root, ["sudo", "-n"] if sudo works, else None."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        return ["sudo", "-n"]
    return None


def _run(cmd: list[str], *, cwd: str | None = None, quiet: bool = False) -> tuple[int, str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    p = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0 and not quiet:
        log(f"`{shlex.join(cmd)}` failed (rc={p.returncode}):\n{p.stdout[-3000:]}")
    return p.returncode, p.stdout


def _missing_apt(packages=APT_PACKAGES) -> list[str]:
    if not shutil.which("dpkg-query"):
        return list(packages)
    p = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *packages],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    installed = {line.split()[0] for line in p.stdout.splitlines()
                 if len(line.split()) >= 2 and line.split()[1].startswith("ii")}
    return [pkg for pkg in packages if pkg not in installed]


_apt_updated = False


def _apt_update(sudo: list[str]) -> str | None:
    global _apt_updated
    if _apt_updated:
        return None
    rc, _ = _run([*sudo, "apt-get", "update", "-q"])
    if rc != 0:
        return "apt-get update failed"
    _apt_updated = True
    return None


def _ensure_apt(sudo: list[str] | None) -> str | None:
    missing = _missing_apt()
    if not missing:
        return None
    if not shutil.which("apt-get"):
        return f"apt packages missing ({' '.join(missing)}) and no apt-get on this machine"
    if sudo is None:
        return f"apt packages missing ({' '.join(missing)}); installing them needs root (or passwordless sudo)"
    log(f"installing apt packages: {' '.join(missing)}")
    why = _apt_update(sudo)
    if why:
        return why
    rc, _ = _run([*sudo, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q",
                  "--no-install-recommends", *missing])
    if rc != 0:
        return f"apt-get install {' '.join(missing)} failed"
    still = _missing_apt()
    return f"apt packages still missing after install: {' '.join(still)}" if still else None


def find_vng() -> str | None:
    """vng of this interpreter's environment first (virtme-ng is pip-installed), then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "vng")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("vng")


def _ensure_pip() -> str | None:
    if find_vng():
        return None
    log(f"installing {' '.join(PIP_PACKAGES)} with {sys.executable} -m pip")
    rc, _ = _run([sys.executable, "-m", "pip", "install", "-q", *PIP_PACKAGES])
    if rc != 0:
        return f"pip install {' '.join(PIP_PACKAGES)} failed"
    return None if find_vng() else "virtme-ng installed but no `vng` next to the interpreter or on PATH"


@dataclasses.dataclass
class Kernel:
    version: str
    image: str  # .../kernel/boot/vmlinuz-<version>
    moddir: str  # .../kernel/lib/modules/<version>


def _kernel_ok(kdir: str) -> Kernel | None:
    """The newest complete kernel unpacked under kdir (image, modules.dep, rdma_rxe), or None."""
    found = []
    for image in glob.glob(os.path.join(kdir, "boot", "vmlinuz-*")):
        ver = os.path.basename(image)[len("vmlinuz-"):]
        moddir = os.path.join(kdir, "lib", "modules", ver)
        if not os.path.isfile(os.path.join(moddir, "modules.dep")):
            continue
        if not glob.glob(os.path.join(moddir, "kernel", "drivers", "infiniband", "sw", "rxe", "rdma_rxe.ko*")):
            continue
        found.append(Kernel(ver, image, moddir))

    def key(k: Kernel):
        return [int(x) if x.isdigit() else x for x in re.split(r"[.-]", k.version)]

    return max(found, key=key) if found else None


def _resolve_kernel_package(sudo: list[str] | None) -> tuple[str | None, str | None]:
    """(package name, None) for the current linux-image-<arch> dependency, or (None, reason)."""
    arch = subprocess.run(["dpkg", "--print-architecture"], stdout=subprocess.PIPE, text=True).stdout.strip()
    meta = f"linux-image-{arch or 'amd64'}"
    for attempt in (0, 1):
        p = subprocess.run(["apt-cache", "depends", meta], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        m = re.search(r"Depends:\s*(linux-image-\d\S*)", p.stdout)
        if m:
            return m.group(1), None
        if attempt == 0:  # no package lists yet (fresh container): update once
            if sudo is None:
                return None, f"`apt-cache depends {meta}` found no kernel and apt-get update needs root"
            why = _apt_update(sudo)
            if why:
                return None, why
    return None, f"`apt-cache depends {meta}` names no linux-image-<version> package"


def ensure_kernel(sudo: list[str] | None = None) -> tuple[Kernel | None, str | None]:
    d = vm_dir()
    real = os.path.realpath(d)
    for masked in _GUEST_MASKED:
        if real == masked or real.startswith(masked + "/"):
            return None, f"KVFLOW_VM_DIR={d} is under {masked}, which the guest mounts over; pick another directory"
    kdir = os.path.join(d, "kernel")
    k = _kernel_ok(kdir)
    if k:
        return k, None
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        return None, f"cannot create {d}: {e} (set KVFLOW_VM_DIR to a writable directory)"
    with open(os.path.join(d, ".lock"), "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # another process may be fetching it right now
        k = _kernel_ok(kdir)
        if k:
            return k, None
        for tool in ("apt-get", "apt-cache", "dpkg-deb", "depmod"):
            if not shutil.which(tool) and not os.path.exists(f"/sbin/{tool}"):
                return None, f"`{tool}` not found: cannot fetch the guest kernel"
        pkg, why = _resolve_kernel_package(sudo)
        if not pkg:
            return None, why
        debs = glob.glob(os.path.join(d, f"{pkg}_*.deb"))
        if not debs:
            log(f"downloading {pkg} into {d}")
            rc, _ = _run(["apt-get", "download", pkg], cwd=d)
            debs = glob.glob(os.path.join(d, f"{pkg}_*.deb"))
            if rc != 0 or not debs:
                return None, f"apt-get download {pkg} failed"
        deb = sorted(debs)[-1]
        tmp = tempfile.mkdtemp(prefix=".kernel-", dir=d)
        log(f"unpacking {os.path.basename(deb)}")
        rc, _ = _run(["dpkg-deb", "-x", deb, tmp])
        if rc != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"dpkg-deb -x {deb} failed"
        vers = [os.path.basename(p)[len("vmlinuz-"):] for p in glob.glob(os.path.join(tmp, "boot", "vmlinuz-*"))]
        if not vers:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"{deb} holds no boot/vmlinuz-*"
        depmod = shutil.which("depmod") or "/sbin/depmod"
        for ver in vers:
            rc, _ = _run([depmod, "-b", tmp, ver])
            if rc != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                return None, f"depmod -b {tmp} {ver} failed"
        if os.path.exists(kdir):
            shutil.rmtree(kdir)
        os.rename(tmp, kdir)
        k = _kernel_ok(kdir)
        if not k:
            return None, f"{deb} unpacked into {kdir} but has no usable kernel with rdma_rxe"
        return k, None


def _kvm_mode() -> str:
    mode = (os.environ.get("KVFLOW_VM_KVM") or "auto").lower()
    return mode if mode in ("auto", "on", "off") else "auto"


def _kvm_cache_key() -> str:
    qemu = shutil.which("qemu-system-x86_64") or ""
    try:
        qemu_m = os.stat(qemu).st_mtime_ns if qemu else 0
    except OSError:
        qemu_m = 0
    return f"{platform.release()} {qemu}:{qemu_m}"


def use_kvm(kernel: Kernel, vng: str, *, probe: bool = True) -> bool:
    """KVM when it actually boots this kernel (some hosts expose a /dev/kvm that
    fails or hangs early in boot); the probe's verdict is cached in KVFLOW_VM_DIR."""
    mode = _kvm_mode()
    if mode == "off":
        return False
    accessible = os.path.exists("/dev/kvm") and os.access("/dev/kvm", os.R_OK | os.W_OK)
    if mode == "on":
        return True
    if not accessible:
        return False
    cache = os.path.join(vm_dir(), "kvm-probe.json")
    key = _kvm_cache_key()
    try:
        with open(cache) as f:
            data = json.load(f)
        if data.get("key") == key:
            return bool(data["ok"])
    except (OSError, ValueError, KeyError):
        pass
    if not probe:
        return False
    log("probing KVM with a short boot (once; the verdict is cached)")
    t0 = time.monotonic()
    cmd = [vng, "-r", kernel.image, "--cpus", "1", "--memory", "512M", "--exec", "echo kvflow-kvm-ok"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_vng_env(vng), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=45)
        ok = proc.returncode == 0 and "kvflow-kvm-ok" in out
    except subprocess.TimeoutExpired:  # e.g. a nested /dev/kvm on which the guest hangs in early boot
        _kill_group(proc)
        proc.communicate()
        ok = False
    log(f"KVM {'works' if ok else 'does not work here; using TCG'} ({time.monotonic() - t0:.0f} s)")
    try:
        with open(cache, "w") as f:
            json.dump({"key": key, "ok": ok}, f)
    except OSError:
        pass
    return ok


def ensure_setup(*, kvm_probe: bool = True) -> str | None:
    """Install what is missing and fetch the guest kernel. None when ready, else the reason."""
    if sys.platform != "linux":
        return "the RDMA VM harness needs Linux"
    if platform.machine() not in ("x86_64", "amd64"):
        return f"the RDMA VM harness supports x86_64 hosts only (this is {platform.machine()})"
    sudo = _sudo()
    why = _ensure_apt(sudo) or _ensure_pip()
    if why:
        return why
    k, why = ensure_kernel(sudo)
    if why:
        return why
    if kvm_probe:
        use_kvm(k, find_vng())
    return None


def _vng_env(vng: str) -> dict[str, str]:
    env = dict(os.environ)
    # vng runs `virtme-run` through the shell: it lives next to vng.
    env["PATH"] = os.pathsep.join([os.path.dirname(vng), env.get("PATH", "/usr/bin:/bin")])
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
