"""python -m kvflow.compat.mooncake.shim: prints the stand-in package's
directory, for PYTHONPATH; with --bin, the directory of the stand-in
executables (mooncake_master, mooncake_http_metadata_server), for PATH."""
import sys

from kvflow.compat.mooncake.shim import bin_path, shim_path

print(bin_path() if "--bin" in sys.argv[1:] else shim_path())
