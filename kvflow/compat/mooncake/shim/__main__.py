"""python -m kvflow.compat.mooncake.shim: prints the stand-in package's
directory, for PYTHONPATH."""
from kvflow.compat.mooncake.shim import shim_path

print(shim_path())
