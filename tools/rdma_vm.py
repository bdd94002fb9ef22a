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
import threading
import time

SETUP_FAILED = 97  # could not set up / VM did not boot / rxe setup failed
TIMED_OUT = 124

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

# Modules udev would load at coldplug for QEMU's emulated hardware. Under TCG each
# costs seconds (kvm alone ~20 s), and none is needed: blacklisting them (kmod honours
# modprobe.blacklist= on the kernel command line) roughly halves the boot.
UDEV_BLACKLIST = (
    "kvm", "kvm_amd", "kvm_intel", "irqbypass", "ccp",
    "aesni_intel", "crypto_simd", "cryptd", "ghash_clmulni_intel", "sha1_ssse3", "sha256_ssse3",
    "sha512_ssse3", "sha512_generic", "crct10dif_pclmul", "crct10dif_common",
    "ahci", "libahci", "libata", "scsi_mod", "scsi_common", "sr_mod", "cdrom", "sg",
    "iTCO_wdt", "iTCO_vendor_support", "intel_pmc_bxt", "lpc_ich", "i2c_i801", "i2c_smbus",
    "evdev", "psmouse", "serio_raw", "pcspkr", "button", "joydev", "snd_pcsp",
)

HOST_TAG = "kvflowhost"  # our second, cached 9p export of the host root
PYC_TAG = "kvflowpyc"  # pycache_dir(), writable
GUEST_PYCACHE = "/run/kvflow-pycache"

DUMMY_PREFIX = "kvfd"
DUMMY_NET = "198.18.{i}.1/24"


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


# ------------------------------------------------------------------ guest script


def _cached_paths(cwd: str) -> list[str]:
    """Host directories to re-mount from the cached 9p export in the guest: the interpreter's
    prefixes and the working directory (where nearly all of the command's file lookups go)."""
    cands = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, cwd)}
    out = []
    for p in sorted(cands, key=len):
        # "/" cannot be re-mounted; the guest's own mounts live under /usr, /etc, /var, /run, /proc...
        if p == "/" or any(p == m or p.startswith(m + "/") for m in ("/usr", "/etc", "/var", "/run", "/proc",
                                                                       "/sys", "/dev", "/boot", "/lib")) \
                or p in ("/root", "/home", "/opt", "/tmp", "/srv"):
            continue
        if any(p.startswith(q + "/") for q in out):
            continue  # inside one already listed
        out.append(p)
    return out


def _guest_script(*, ctl: str, cmd: list[str], cwd: str, env: dict[str, str], devices: int, netdev: str,
                  fast_fs: bool = False, cached: list[str] = ()) -> str:
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        "# generated by tools/rdma_vm.py; runs as root in the guest",
        f"CTL={q(ctl)}",
        'cat /proc/uptime > "$CTL/started"',
        "fail() {",
        '  echo "kvflow-vm: $*" >&2',
        '  printf "%s\\n" "$*" > "$CTL/setup_error"',
        "  exit 97",
        "}",
        "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "ip link set lo up || fail 'ip link set lo up failed'",
        # ib_uverbs (/dev/infiniband/uverbsN, libibverbs) and rdma_ucm (/dev/infiniband/rdma_cm,
        # librdmacm) are loaded here rather than left to udev's rdma-core rules, which race the command.
        "for m in rdma_rxe ib_uverbs rdma_ucm; do",
        "  modprobe $m || fail \"modprobe $m failed (kernel $(uname -r))\"",
        "done",
    ]
    if netdev == "lo":
        pairs = [("rxe0", "lo", "127.0.0.1")]
    else:
        lines.append("modprobe dummy || fail 'modprobe dummy failed'")
        pairs = []
        for i in range(devices):
            nd = f"{DUMMY_PREFIX}{i}"
            cidr = DUMMY_NET.format(i=i)
            lines += [
                f"ip link add {nd} type dummy || fail 'ip link add {nd} type dummy failed'",
                f"ip addr add {cidr} dev {nd} || fail 'ip addr add {cidr} dev {nd} failed'",
                f"ip link set {nd} up || fail 'ip link set {nd} up failed'",
            ]
            pairs.append((f"rxe{i}", nd, cidr.split("/")[0]))
    for dev, nd, _ in pairs:
        lines.append(f"rdma link add {dev} type rxe netdev {nd} || fail 'rdma link add {dev} type rxe netdev {nd} failed'")
    # Wait (up to 30 s) until every port is ACTIVE and carries its IPv4-mapped RoCE v2 GID.
    lines += [
        "gid_index() {  # $1=dev $2=ipv4 -> index of ::ffff:ipv4 with type RoCE v2",
        '  want=$(printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" $(echo "$2" | tr . " "))',
        '  for g in /sys/class/infiniband/$1/ports/1/gids/*; do',
        '    n=${g##*/}',
        '    [ "$(cat "$g" 2>/dev/null)" = "$want" ] || continue',
        '    t=$(cat /sys/class/infiniband/$1/ports/1/gid_attrs/types/$n 2>/dev/null)',
        '    case "$t" in *v2*) echo "$n"; return 0;; esac',
        "  done",
        "  return 1",
        "}",
        "i=0",
        "while :; do",
        "  ok=1",
    ]
    for dev, _, ip in pairs:
        lines += [
            f"  rdma link show {dev}/1 2>/dev/null | grep -q 'state ACTIVE' || ok=0",
            f"  gid_index {dev} {ip} >/dev/null || ok=0",
            f"  grep -qx {dev} /sys/class/infiniband_verbs/uverbs*/ibdev 2>/dev/null || ok=0",
        ]
    lines += [
        '  [ "$ok" = 1 ] && break',
        "  i=$((i+1))",
        '  if [ "$i" -ge 150 ]; then',
        '    echo "kvflow-vm: rdma link:" >&2; rdma link >&2',
        "    fail 'not every rxe device became ACTIVE with its IPv4-mapped RoCE v2 GID and a uverbs node within 30 s: "
        + " ".join(d for d, _, _ in pairs) + "'",
        "  fi",
        "  sleep 0.2",
        "done",
    ]
    for dev, nd, ip in pairs:
        lines.append(f'echo "kvflow-vm: $(rdma link show {dev}/1) gid[$(gid_index {dev} {ip})]=::ffff:{ip} RoCE v2" >&2')
    lines += [
        'cat /proc/uptime > "$CTL/ready"',
    ]
    if fast_fs:
        # virtme's root export is 9p without caching: every path component of every lookup is a
        # round trip through the emulated virtio device (python3 -c pass took ~18 s under TCG).
        # A second export of / mounted cache=loose, bound over the interpreter's prefix and the
        # working directory, caches dentries and pages. Skipped for a path that has mounts
        # (e.g. an --rwdir) inside it, which the bind would hide; read-only either way.
        # Byte code: PYTHONPYCACHEPREFIX points at a writable cached mount of pycache_dir(),
        # so what one run (or a host-side warm-up, see pycache_env) compiled, the next reuses.
        lines += [
            f"mkdir -p /run/kvflow-host {GUEST_PYCACHE}",
            f"mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose {PYC_TAG} {GUEST_PYCACHE} || "
            f"echo 'kvflow-vm: byte-code cache not mounted; Python compiles into the guest-private {GUEST_PYCACHE}' >&2",
            f"if mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro {HOST_TAG} /run/kvflow-host; then",
            "  for p in " + " ".join(q(p) for p in cached or ["/nonexistent-kvflow"]) + "; do",
            '    [ -d "$p" ] || continue',
            '    if awk -v p="$p" \'$2 == p || index($2, p "/") == 1 {f=1} END {exit !f}\' /proc/self/mounts; then',
            '      echo "kvflow-vm: $p holds mounts; not caching it" >&2; continue',
            "    fi",
            '    mount --bind "/run/kvflow-host$p" "$p" || echo "kvflow-vm: cannot cache $p" >&2',
            "  done",
            "else",
            "  echo 'kvflow-vm: cached 9p export not mounted; file access stays slow' >&2",
            "fi",
        ]
    lines += [
        "ulimit -l unlimited 2>/dev/null",
        f"cd {q(cwd)} || fail {q(f'cannot cd to {cwd} in the guest')}",
    ]
    for k in sorted(env):
        lines.append(f"export {k}={q(env[k])}")
    lines += [
        shlex.join(cmd),
        "rc=$?",
        'echo "$rc" > "$CTL/rc"',
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def pycache_dir() -> str:
    """Where the guest's Python byte code lives (PYTHONPYCACHEPREFIX in the guest), kept between runs."""
    return os.path.join(vm_dir(), "pycache")


def pycache_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a host-side warm-up run (e.g. ``pytest --co`` of what the VM will run):
    it writes the byte code of everything it imports where the guest looks for it, so that the
    guest, where compiling is ~20x slower, does not have to."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = pycache_dir()
    return env


def _guest_env(devices: int, extra: dict[str, str] | None, pycache: bool = False) -> dict[str, str]:
    env = {
        "KVFLOW_IN_VM": "1",
        # Emulation stalls a loop for seconds at times: a 5 s keepalive would
        # declare live peers lost.
        "KVFLOW_KEEPALIVE": "60",
        "KVFLOW_RDMA_DEVICES": ",".join(f"rxe{i}" for i in range(devices)),
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/sbin", "/usr/local/bin",
                                 "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        # Hypothesis' default database is ./.hypothesis, unwritable on the read-only root.
        "HYPOTHESIS_STORAGE_DIRECTORY": "/tmp/kvflow-hypothesis",
    }
    if pycache:
        # Byte code goes to a writable, cached mount of pycache_dir() (kept between runs):
        # nothing is written next to the sources, so writing it is safe.
        env["PYTHONPYCACHEPREFIX"] = GUEST_PYCACHE
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the root filesystem is read-only in the guest
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    addopts = os.environ.get("PYTEST_ADDOPTS", "")
    if "cacheprovider" not in addopts:
        addopts = (addopts + " -p no:cacheprovider").strip()
    env["PYTEST_ADDOPTS"] = addopts
    # The rest of the kvflow knobs, CI and HYPOTHESIS_* follow the command into the guest.
    for k, v in os.environ.items():
        if (k.startswith("KVFLOW_") and k not in env and not k.startswith("KVFLOW_VM_")) or k in ("CI", "TERM") \
                or k.startswith("HYPOTHESIS_"):
            env.setdefault(k, v)
    env.update(extra or {})
    return env


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


def _vng_env(vng: str) -> dict[str, str]:
    env = dict(os.environ)
    # vng runs `virtme-run` through the shell: it lives next to vng.
    env["PATH"] = os.pathsep.join([os.path.dirname(vng), env.get("PATH", "/usr/bin:/bin")])
    return env


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
