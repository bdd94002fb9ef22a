"""Registers kvflow as SGLang's "kvflow" transfer backend once SGLang's
disaggregation utils are imported (see kvflow.compat.sglang.shim)."""
from __future__ import annotations

import importlib.abc
import sys

_TARGET = "sglang.srt.disaggregation.utils"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of _TARGET so that
    install() runs right after the module has executed."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001 - the finder protocol
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                real = spec.loader

                class Loader(importlib.abc.Loader):
                    def __getattr__(self, name):  # noqa: ANN001 - get_source etc.: tracebacks, inspect
                        return getattr(real, name)

                    def create_module(self, spec):  # noqa: ANN001
                        return real.create_module(spec)

                    def exec_module(self, module):  # noqa: ANN001
                        real.exec_module(module)
                        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]
                        import kvflow.compat.sglang
                        kvflow.compat.sglang.install()

                spec.loader = Loader()
                return spec
        return None


sys.meta_path.insert(0, _AfterImport())
