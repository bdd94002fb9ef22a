"""`mooncake.async_store.MooncakeDistributedStoreAsync`: every call of
MooncakeDistributedStore as `async_<name>`, run on the event loop's default
executor (as Mooncake's wrapper does): the blocking call waits on a worker
thread, and kvflow's store loop runs it meanwhile."""
from __future__ import annotations

import asyncio
import functools
from typing import Any

from kvflow.compat.mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    def __getattr__(self, name: str) -> Any:
        if not name.startswith("async_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        method = getattr(self, name[len("async_"):], None)
        if not callable(method):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor '{name[6:]}')")

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(method, *args, **kwargs))

        setattr(self, name, call)
        return call
