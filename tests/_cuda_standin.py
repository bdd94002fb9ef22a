"""The CUDA driver stand-in (tests/cuda_standin/*.c; cuda_standin.h says what
each part holds): built here with cc into a directory as one libcuda.so.1,
which cuda-bindings then loads (cuda.pathfinder dlopens "libcuda.so.1":
LD_LIBRARY_PATH finds it) in the processes given env(). A test double, never
a GPU result (docs/gpu.md).

The stand-in is never loaded into the main pytest process: the rest of the
suite checks what kvflow does where CUDA is not usable, and kvflow caches
that answer. tests/test_cuda_standin.py runs tests/cuda_standin/cases.py
(and store_cases.py) in a pytest of its own under it.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
STANDIN_DIR = os.path.join(TESTS_DIR, "cuda_standin")
# its parts, compiled together (cuda_standin.h: the shared types and state)
SOURCES = [os.path.join(STANDIN_DIR, f) for f in ("state.c", "devices.c", "memory.c", "streams.c", "kernels.c",
                                                   "hooks.c", "procaddr.c")]
CASES = os.path.join(TESTS_DIR, "cuda_standin", "cases.py")
# every file of cases run under it (store_cases.py: the pool's GPU callers)
CASE_FILES = (CASES, os.path.join(TESTS_DIR, "cuda_standin", "store_cases.py"))
HEADERS = os.path.join(ROOT, "kvflow", "_cuda")       # putring.cuh: the put ring's device side, for kvf_layer_put


def cuda_include() -> str | None:
    """The CUDA toolkit's include directory (cuda.h, cudaTypedefs.h): the
    stand-in is compiled against the driver API's own declarations."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None]
    for r in roots:
        for sub in ("include", "targets/x86_64-linux/include"):
            if r and os.path.exists(os.path.join(r, sub, "cudaTypedefs.h")):
                return os.path.join(r, sub)
    return None


def build(dest: str) -> str:
    """Compiles the stand-in into dest/libcuda.so.1; returns dest. Raises
    RuntimeError saying what is missing or what the compiler said."""
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = cuda_include()
    if cc is None or inc is None:
        raise RuntimeError(f"cannot build the CUDA stand-in: cc={cc}, cuda.h in {inc} (needs a C compiler and "
                           "the CUDA toolkit's headers)")
    out = subprocess.run([cc, "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-shared",
                          "-fPIC", "-pthread", "-Wl,-soname,libcuda.so.1", f"-I{inc}", f"-I{HEADERS}",
                          "-o", os.path.join(dest, "libcuda.so.1"), *SOURCES], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building the CUDA stand-in failed:\n{out.stderr}")
    return dest


def env(libdir: str) -> dict[str, str]:
    """The environment of a process that runs under the stand-in."""
    e = dict(os.environ)
    e["LD_LIBRARY_PATH"] = libdir + (":" + e["LD_LIBRARY_PATH"] if e.get("LD_LIBRARY_PATH") else "")
    e["PYTHONPATH"] = ROOT + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["KVFLOW_CUDA_STANDIN"] = libdir
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def hooks() -> ctypes.CDLL | None:
    """The stand-in's test hooks, in a process running under it; None
    elsewhere (no libcuda.so.1, or a real one)."""
    if not os.environ.get("KVFLOW_CUDA_STANDIN"):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if not hasattr(lib, "kvfstandin_count"):
        return None
    lib.kvfstandin_count.restype = ctypes.c_long
    lib.kvfstandin_count.argtypes = [ctypes.c_char_p]
    lib.kvfstandin_peek.restype = ctypes.c_void_p
    lib.kvfstandin_peek.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    lib.kvfstandin_delay.restype = ctypes.c_int
    lib.kvfstandin_delay.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.kvfstandin_copy_delay.argtypes = [ctypes.c_long]
    lib.kvfstandin_last_error.restype = ctypes.c_char_p
    return lib
