"""kvflow's stand-in for the `mooncake` package: `mooncake.engine` is
kvflow.compat.mooncake (Mooncake's TransferEngine API on kvflow),
`mooncake.store` is kvflow.compat.mooncake.store (Mooncake Store's
MooncakeDistributedStore on kvflow.store), `mooncake.mooncake_config` and
`mooncake.async_store` are kvflow's. Mooncake's EP and other modules are
not there; where the Mooncake wheel is installed as well, its pure-Python
modules that kvflow does not replace (structured_object_store, ...) are
found in it, after these (so `mooncake.store` inside them is kvflow's)."""
import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _wheel_dirs() -> list:
    here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = _machinery.PathFinder.find_spec("mooncake", rest)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    return [d for d in dirs if _os.path.abspath(d) != _os.path.dirname(_os.path.abspath(__file__))]


__path__ = list(__path__) + _wheel_dirs()  # noqa: F821 - the package's own __path__
