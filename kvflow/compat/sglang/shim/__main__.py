"""python -m kvflow.compat.sglang.shim: prints the directory for PYTHONPATH."""
from kvflow.compat.sglang.shim import shim_path

print(shim_path())
