"""The master's calls for the SSD tier (model.py's SSD section holds the
state; ssd_agent.py is the client that makes them). A mixin of Master, so
the dispatcher finds them as `_<name>` like every other call."""
from __future__ import annotations

from typing import Any

from kvflow.errors import KVFlowError

from .errors import error_code
from .wire import item_error

__all__ = ["SSD_METHODS", "SsdCalls"]

SSD_METHODS = ("ssd_attach", "batch_ssd_add", "batch_ssd_drop", "ssd_sync", "batch_promote_start",
               "batch_promote_end", "batch_ssd_request", "batch_ssd_load_start")

# "evict" mode: a tier copies the objects among the oldest whose DRAM bytes
# exceed this far below the low watermark, so a copy is usually on disk
# before the eviction that would take the object comes
OFFLOAD_MARGIN = 0.15


class SsdCalls:
    model: Any

    def _ssd_holders(self, obj: Any) -> list:
        """[[client, engine, host, directory], ...] of an object's SSD copies."""
        out = []
        for cid in obj.ssd:
            c = self.model.clients.get(cid)
            if c is not None:
                out.append([c.id, c.engine, c.host, c.ssd_dir])
        return out

    def _ssd_attach(self, cid: str, now: float, directory: str, mode: str) -> None:
        self.model.ssd_attach(cid, directory, mode)

    def _batch_ssd_add(self, cid: str, now: float, items: list, adopt: bool = False) -> list:
        """[key, size] per copy written (or adopted); one bool per item."""
        add = self.model.ssd_add
        out = []
        for key, size in items:
            try:
                out.append(add(cid, key, size, adopt=bool(adopt)))
            except KVFlowError:
                out.append(False)
        return out

    def _batch_ssd_drop(self, cid: str, now: float, keys: list, declined: bool = False) -> int:
        return sum(self.model.ssd_drop(cid, k, declined=bool(declined)) for k in keys if isinstance(k, str))

    def _ssd_sync(self, cid: str, now: float, limit: int) -> dict:
        """What the client's tier should do: "drop" (copies of removed
        objects), "offload" ([key, address in its segment, size], under
        "lease")."""
        m = self.model
        c = m.clients[cid]
        loads = m.ssd_loads.pop(cid, None)
        out: dict = {"drop": m.take_ssd_drops(cid), "offload": [], "lease": 0, "load": list(loads or ())}
        if not c.ssd_mode or limit <= 0:
            return out
        mark = max(0.0, m.low_watermark - OFFLOAD_MARGIN)
        lease, objs = m.ssd_candidates(cid, now, int(limit), eager=c.ssd_mode == "eager", mark=mark)
        mine = c.segments
        for obj in objs:
            for r in obj.replicas:
                if r.segment in mine:
                    seg = m.segments[r.segment]
                    out["offload"].append([obj.key, seg.base + r.offset, obj.size])
                    break
        out["lease"] = lease
        return out

    def _batch_promote_start(self, cid: str, now: float, keys: list) -> dict:
        segments: dict = {}
        out = []
        for key in keys:
            try:
                reps = self.model.promote_start(cid, key, now)
                out.append([0, None if reps is None else self._replicas(reps, segments)])
            except KVFlowError as e:
                out.append(item_error(error_code(e), str(e)))
        return {"segments": segments, "items": out}

    def _batch_ssd_request(self, cid: str, now: float, keys: list) -> list:
        out = []
        holders = set()
        for key in keys:
            try:
                asked = self.model.ssd_request(key)
            except KVFlowError:
                asked = False
            if asked:
                holders.add(next(iter(self.model.objects[key].ssd)))
            out.append(asked)
        # the holders act now, not at their cleaner's next poll (up to
        # ssd_agent.IDLE_POLL later): the reader waits for them
        for holder in holders:
            self.push(holder, "ssd_wake")
        return out

    def _batch_ssd_load_start(self, cid: str, now: float, keys: list) -> list:
        """A holder loading its SSD copies for readers elsewhere: a DRAM
        replica in its own segment (None where none fits or it has one):
        [[key, address in its segment, size], ...]."""
        m = self.model
        segs = m.clients[cid].segments
        out = []
        for key in keys:
            try:
                obj = m.objects.get(key)
                own = next(iter(segs), None)
                reps = m.promote_start(cid, key, now, preferred=own) if obj is not None and own else None
            except KVFlowError:
                reps = None
            if reps and reps[0].segment in segs:
                out.append([key, m.segments[reps[0].segment].base + reps[0].offset, obj.size])
            elif reps:
                m.promote_end(cid, key, False)      # not in its segment: it cannot read its file there
        return out

    def _batch_promote_end(self, cid: str, now: float, items: list) -> list:
        return [self.model.promote_end(cid, key, bool(ok)) for key, ok in items]
