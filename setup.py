"""Builds kvflow's native core (Cython over plain C)."""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

NATIVE = [f"kvflow/_native/{name}.c" for name in ("core", "local", "sockio", "tcp_client", "tcp_server")]
debug = os.environ.get("KVFLOW_DEBUG") == "1"
cflags = ["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-pthread"]
if debug:
    cflags = ["-O0", "-g", "-std=gnu11", "-Wall", "-pthread", "-DKVF_DEBUG=1"]

extensions = [
    Extension(
        "kvflow._core",
        ["kvflow/_core.pyx", *NATIVE],
        include_dirs=["kvflow", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=cflags,
        extra_link_args=["-pthread"],
        depends=["kvflow/_native/kvf.h", "kvflow/_native/wire.h", "kvflow/_native/sockio.h", "kvflow/_native.pxd"],
    )
]

setup(
    ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"},
                          compile_time_env={"KVFLOW_DEBUG": int(debug)}),
)
