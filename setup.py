"""Builds kvflow's native core (Cython over plain C)."""
import os
import shutil
import subprocess

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = [f"kvflow/_native/{name}.c" for name in ("core", "sched", "local", "fence", "sockio", "tcp_client", "tcp_conn",
                                                   "tcp_send", "tcp_server", "credit")]
RDMA = [f"kvflow/_native/{name}.c" for name in ("rdma_events", "rdma_post", "rdma_worker", "rdma_chan", "rdma_credit", "rdma_ibgda")]
debug = os.environ.get("KVFLOW_DEBUG") == "1"
cflags = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread"]
if debug:
    cflags = ["-O0", "-g", "-std=gnu11", "-Wall", "-pthread", "-DKVF_DEBUG=1"]

def have_verbs() -> bool:
    """libibverbs headers present (Debian: libibverbs-dev)? Without them
    the rdma provider is not built and kvflow.features says so."""
    if os.environ.get("KVFLOW_NO_VERBS") == "1":
        return False
    return any(os.path.exists(os.path.join(d, "infiniband", "verbs.h"))
               for d in ("/usr/include", "/usr/local/include"))


def have_mlx5dv() -> bool:
    """rdma-core's mlx5 direct verbs (Debian: libibverbs-dev) for IBGDA."""
    return any(os.path.exists(os.path.join(d, "infiniband", "mlx5dv.h"))
               for d in ("/usr/include", "/usr/local/include"))


def find_nvcc() -> str | None:
    """nvcc for the CUDA module's device code: KVFLOW_CUDA=off skips it,
    on requires it, auto (the default) builds it where nvcc is found."""
    mode = os.environ.get("KVFLOW_CUDA", "auto").lower()
    if mode not in ("auto", "on", "off"):
        raise SystemExit(f"KVFLOW_CUDA must be auto, on or off, not {mode!r}")
    if mode == "off":
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or next(
        (p for p in (os.path.join(cuda_home, "bin", "nvcc"),) if os.path.exists(p)), None)
    if nvcc is None and mode == "on":
        raise SystemExit("KVFLOW_CUDA=on but nvcc is not on PATH nor in $CUDA_HOME/bin")
    return nvcc


# Hopper and Ampere machine code, plus Hopper PTX the driver compiles for
# anything newer.
NVCC_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"]
CUDA_SOURCE = "kvflow/_cuda/kernels.cu"
CUDA_FATBIN = "kvflow/_cuda/kvflow_kernels.fatbin"


class BuildWithCuda(build_ext):
    """build_ext, and then the CUDA module's fatbin when nvcc is found
    (into the source tree for in-place builds, else into build_lib)."""

    def run(self) -> None:
        super().run()
        nvcc = find_nvcc()
        out = CUDA_FATBIN if self.inplace else os.path.join(self.build_lib, CUDA_FATBIN)
        if nvcc is None:
            if self.inplace and os.path.exists(CUDA_FATBIN):
                os.remove(CUDA_FATBIN)      # KVFLOW_CUDA=off: not built, and features say so
            return
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [nvcc, "-fatbin", "-O3", *NVCC_ARCHS, "-o", out, CUDA_SOURCE]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)


extensions = [
    Extension(
        "kvflow._core",
        ["kvflow/_core.pyx", *NATIVE],
        include_dirs=["kvflow", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=cflags,
        extra_link_args=["-pthread"],
        depends=["kvflow/_native/kvf.h", "kvflow/_native/fence.h", "kvflow/_native/provider.h", "kvflow/_native/wire.h", "kvflow/_native/sockio.h",
                 "kvflow/_native/tcp_int.h",
                 "kvflow/_native.pxd", "kvflow/_core.pxd",
                 *(f"kvflow/_core_{name}.pxi" for name in ("channel", "local", "pairs", "tcp", "sched"))],
    ),
    # relay lanes in shared memory (kvflow.paths.relay.lanes)
    Extension("kvflow._lanes", ["kvflow/_lanes.pyx"], include_dirs=["kvflow"], extra_compile_args=cflags,
              libraries=["rt"], depends=["kvflow/_native/atomics.h"]),
    Extension("kvflow._putring", ["kvflow/_putring.pyx"], include_dirs=["kvflow"], extra_compile_args=cflags,
              depends=["kvflow/_native/atomics.h"]),
]
if have_verbs():
    extensions.append(Extension(
        "kvflow._verbs",
        # core.c is compiled in again: the batch pool and completion ring
        # code must be reachable from the rdma workers; so is credit.c, the
        # receive window's pool, which rdma target QPs join. The state itself
        # is the one context that kvflow._core created.
        ["kvflow/_verbs.pyx", "kvflow/_native/core.c", "kvflow/_native/sched.c", "kvflow/_native/credit.c", *RDMA],
        include_dirs=["kvflow", numpy.get_include()],
        extra_compile_args=cflags + ["-fvisibility=hidden"],
        extra_link_args=["-pthread"],
        # mlx5: IBGDA's mlx5dv_init_obj (rdma_ibgda.c), where rdma-core ships it
        libraries=["ibverbs", "mlx5"] if have_mlx5dv() else ["ibverbs"],
        define_macros=[] if have_mlx5dv() else [("KVF_NO_MLX5DV", "1")],
        depends=["kvflow/_native/kvf.h", "kvflow/_native/provider.h", "kvflow/_native/rdma.h",
                 "kvflow/_native/rdma_ibgda.h",
                 "kvflow/_native/rdma_int.h", "kvflow/_native.pxd", "kvflow/_verbs.pxd", "kvflow/_core.pxd",
                 "kvflow/_verbs_qp.pxi", "kvflow/_verbs_channel.pxi"],
    ))

setup(
    cmdclass={"build_ext": BuildWithCuda},
    ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"},
                          compile_time_env={"KVFLOW_DEBUG": int(debug)}),
)
