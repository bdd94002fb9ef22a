"""GPU memory support, as users see it: whether CUDA is usable here, and
how many devices there are. `import kvflow` imports nothing of CUDA; this
module imports cuda-python only when one of its functions is called.

    >>> import kvflow.cuda
    >>> kvflow.cuda.available()       # False, never an exception, without a driver
"""
from __future__ import annotations

from kvflow._cuda import built
from kvflow._cuda.driver import available, device_count, reason

__all__ = ["available", "built", "device_count", "reason"]
