"""The rdma provider's part of an engine's descriptor: the devices in
service and the probe region, as the wire carries them under "rdma", and
the check a received part must pass before anything reads it. Registered
with kvflow.control.descriptor when this package is imported, so control/
carries the part without knowing what is in it."""
from __future__ import annotations

from typing import Any

from kvflow._core import MAX_DEVS
from kvflow.control.descriptor import register_part
from kvflow.errors import ProtocolError

__all__ = ["rdma_from_wire"]


def rdma_from_wire(v: Any) -> dict[str, Any] | None:
    """The rdma part of a descriptor: {"devices": [{name, gid, lid, mtu,
    link, port}], "probe": [addr, [rkey per device], cookie]}, checked."""
    if v is None:
        return None
    try:
        devices = v["devices"]
        addr, rkeys, cookie = v["probe"]
        ok = (isinstance(devices, list) and 0 < len(devices) <= MAX_DEVS and isinstance(addr, int)
              and 0 < addr < 1 << 64 and isinstance(rkeys, list) and len(rkeys) == len(devices)
              and all(isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys)
              and isinstance(cookie, bytes) and 0 < len(cookie) <= 64)
        for d in devices:
            ok = ok and (isinstance(d.get("name"), str) and isinstance(d.get("gid"), bytes)
                         and len(d["gid"]) == 16 and isinstance(d.get("lid"), int)
                         and isinstance(d.get("mtu"), int) and 1 <= d["mtu"] <= 5
                         and isinstance(d.get("up", True), bool))
        if not ok:
            raise ValueError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ProtocolError("descriptor: malformed rdma section") from None
    return {"devices": devices, "probe": [addr, rkeys, cookie]}


register_part("rdma", rdma_from_wire)
