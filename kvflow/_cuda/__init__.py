"""kvflow's CUDA module: the driver API through cuda-python (driver.py),
the nvcc-built device code (kernels.cu, loaded by kernels.py), and what
was built (built()). Importing it imports nothing of CUDA; kvflow itself
never imports it unless GPU memory is registered or kvflow.cuda is used."""
from __future__ import annotations

import os

__all__ = ["FATBIN", "built"]

FATBIN = os.path.join(os.path.dirname(__file__), "kvflow_kernels.fatbin")


def built() -> bool:
    """Whether this kvflow was built with its CUDA module: nvcc compiled
    the device code (setup.py, KVFLOW_CUDA=auto|on|off). Devices are
    looked for at run time (kvflow.cuda.available())."""
    return os.path.exists(FATBIN)
