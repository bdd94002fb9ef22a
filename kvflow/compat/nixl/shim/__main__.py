"""python -m kvflow.compat.nixl.shim: prints the stand-in package's
directory, for PYTHONPATH."""
from kvflow.compat.nixl.shim import shim_path

print(shim_path())
