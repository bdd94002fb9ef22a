"""Builds kvflow's native core (Cython over plain C)."""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

NATIVE = [f"kvflow/_native/{name}.c" for name in ("core", "sched", "local", "sockio", "tcp_client", "tcp_send", "tcp_server", "credit")]
RDMA = [f"kvflow/_native/{name}.c" for name in ("rdma_events", "rdma_post", "rdma_worker", "rdma_chan", "rdma_credit")]
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


extensions = [
    Extension(
        "kvflow._core",
        ["kvflow/_core.pyx", *NATIVE],
        include_dirs=["kvflow", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=cflags,
        extra_link_args=["-pthread"],
        depends=["kvflow/_native/kvf.h", "kvflow/_native/provider.h", "kvflow/_native/wire.h", "kvflow/_native/sockio.h",
                 "kvflow/_native/tcp_int.h",
                 "kvflow/_native.pxd"],
    )
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
        libraries=["ibverbs"],
        depends=["kvflow/_native/kvf.h", "kvflow/_native/provider.h", "kvflow/_native/rdma.h",
                 "kvflow/_native/rdma_int.h", "kvflow/_native.pxd", "kvflow/_verbs.pxd", "kvflow/_core.pxd"],
    ))

setup(
    ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"},
                          compile_time_env={"KVFLOW_DEBUG": int(debug)}),
)
