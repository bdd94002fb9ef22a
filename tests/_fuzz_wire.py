"""Hypothesis strategies for the fuzz tests: msgpack junk, wire values
(descriptors, regions, rdma parts) with at most one fault at a decoder's
limit, and control messages that are almost right. Shared by
test_fuzz_decoders.py and test_fuzz_control.py; see tests/_fuzz_rig.py for
what is fuzzed and how.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from hypothesis import strategies as st

from kvflow.control.wire import (
    VERSION,
)
from kvflow.control.auth import NONCE_BYTES
from kvflow.memory import Access, RemoteRegion
from _fuzz_rig import LEN, U64, weighted

# ---------------------------------------------------------------- msgpack strategies

scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), U64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=40))
# Integers at the limits the decoders check (ports, QP numbers, keys, mtu,
# 64-bit addresses and their sums), and byte strings at the lengths they check.
edge_ints = st.sampled_from([-(1 << 63), -2, -1, 0, 1, 2, 5, 6, 8, 9, 65535, 65536, (1 << 24) - 1, 1 << 24,
                             (1 << 31) - 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, U64 - 4096,
                             U64 - 1])
edge_bytes = st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65]).map(lambda n: b"\x5a" * n)
keys = st.text(max_size=8) | st.binary(max_size=4)
junk = st.recursive(
    scalars | edge_ints,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)


def wire(value: Any) -> Any:
    """`value` as the other side decodes it (lists, not tuples; str or bytes keys)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """`value` with one or two of its parts (or itself) replaced by junk
    or by a value of the same type at a checked limit, removed, or grown:
    mostly almost right, so each check gets its turn."""
    value = wire(value)                            # a deep copy
    for _ in range(draw(st.integers(1, 2))):
        # the whole value last: hypothesis favours the first choices
        paths = _paths(value)
        path = draw(st.sampled_from(paths[1:] + paths[:1]))
        parent, node = None, value
        for step in path:
            parent, node = node, node[step]
        op = draw(st.sampled_from(["junk", "limit", "limit", "drop", "grow"]))
        if op == "limit":
            if isinstance(node, bool) or node is None:
                new = draw(junk)
            elif isinstance(node, int):
                new = draw(edge_ints)
            elif isinstance(node, bytes):
                new = draw(edge_bytes)
            elif isinstance(node, str):
                new = draw(st.text(max_size=3))
            else:
                new = draw(junk)
        elif op == "grow" and isinstance(node, (list, dict)):
            if isinstance(node, list):
                # a copy of the last element (lists of checked length), or junk
                node += wire(node[-1:]) * draw(st.integers(1, 8)) if node and draw(st.booleans()) else [draw(junk)]
            else:
                node[draw(keys)] = draw(junk)
            continue
        elif op == "drop" and parent is not None:
            del parent[path[-1]]
            continue
        else:
            new = draw(junk)
        if parent is None:
            value = new
        else:
            parent[path[-1]] = new
    return value


def good_descriptor_wire() -> dict[str, Any]:
    return {
        "address": "127.0.0.1:7000", "incarnation": 5, "host": "boot/1", "pid": 4242,
        "process": b"\x01" * 16, "probe": [0x7F0000001000, b"c" * 16], "data": [["127.0.0.1", 7001]],
        "generation": 3,
        "regions": [[0x7F0000100000, 4096, 3, "kv", [1, 2]], [0x7F0000200000, 8192, 1, None, []]],
        "rdma": {"devices": [{"name": "mlx5_0", "gid": b"g" * 16, "lid": 0, "mtu": 5, "link": "Ethernet",
                              "port": 1}],
                 "probe": [0x7F0000300000, [77], b"p" * 16]},
    }


def check_regions(regions: Any) -> None:
    assert isinstance(regions, list)
    for r in regions:
        assert isinstance(r, RemoteRegion)
        assert type(r.addr) is int and type(r.length) is int
        assert 0 < r.addr and 0 < r.length and r.addr + r.length <= U64
        assert r.name is None or isinstance(r.name, str)
        assert isinstance(r.access, Access) and len(r.rkeys) <= 8
        assert all(isinstance(k, int) and 0 <= k < 1 << 32 for k in r.rkeys)


def check_rdma(rd: Any) -> None:
    if rd is None:
        return
    devices = rd["devices"]
    addr, rkeys, cookie = rd["probe"]
    assert 0 < len(devices) <= 8 and len(rkeys) == len(devices)
    assert all(isinstance(k, int) and 0 <= k < 1 << 32 for k in rkeys)
    assert isinstance(addr, int) and 0 < addr < U64 and isinstance(cookie, bytes) and 0 < len(cookie) <= 64
    for d in devices:
        assert isinstance(d["name"], str) and isinstance(d["gid"], bytes) and len(d["gid"]) == 16
        assert isinstance(d["lid"], int) and isinstance(d["mtu"], int) and 1 <= d["mtu"] <= 5
        assert isinstance(d.get("up", True), bool)          # False: the device is gone


# Wire values with at most one fault: one leaf (named by `fault`) is drawn
# from values at or just past the limit its decoder checks, every other leaf
# is well formed. So an example either must be accepted or fails exactly one
# check, and each check gets its turn.
def sized_bytes(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo, hi).map(lambda n: b"\x5a" * n)


addr64 = weighted((3, st.integers(1, 1 << 47)), (1, st.sampled_from([1, 1 << 63, U64 - 4096, U64 - 1])))
u32 = st.integers(0, (1 << 32) - 1)
REGION_FAULTS = ["addr", "length", "name", "rkeys", "shape"]
RDMA_FAULTS = ["devices", "name", "gid", "lid", "mtu", "up", "addr", "rkeys", "cookie", "shape"]
# (the region and rdma checks have tests of their own: two of each here)
DESCRIPTOR_FAULTS = ["address", "incarnation", "host", "pid", "process", "probe", "cookie", "data", "generation",
                     "missing", "region.length", "region.rkeys", "rdma.devices", "rdma.mtu"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """Which leaf sits at an edge (`name`, "" for none) and which of its edge
    values (`index`; None: hypothesis picks one)."""

    name: str = ""
    index: int | None = None

    def inner(self, scope: str) -> Fault:
        """This fault as seen inside `scope` ("region.mtu" is "mtu" there)."""
        where, _, name = self.name.partition(".")
        return Fault(name if where == scope else "", self.index)


def pick(draw: st.DrawFn, fault: Fault, options: list[Any]) -> Any:
    return options[fault.index % len(options)] if fault.index is not None else draw(st.sampled_from(options))


def leaf(draw: st.DrawFn, fault: Fault, name: str, good: st.SearchStrategy, *edges: Any) -> Any:
    return pick(draw, fault, list(edges)) if fault.name == name else draw(good)


# Regions at the top of the address space: (addr, length) on both sides of 2^64.
REGION_ENDS = [(1, 0), (1, -1), (1 << 63, 1 << 63), (1 << 63, (1 << 63) + 1), (U64 - 4096, 4096),
               (U64 - 4096, 4097), (U64 - 1, 1), (U64 - 1, 2), (1, U64 - 1), (2, U64 - 1)]


@st.composite
def wire_region(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    if fault.name == "length":
        addr, length = pick(draw, fault, REGION_ENDS)
    else:
        addr = leaf(draw, fault, "addr", addr64, 0, -1, 1, U64 - 1, "1")
        room = U64 - addr if isinstance(addr, int) and 0 < addr < U64 else 4096
        length = draw(weighted((3, st.integers(1, min(1 << 30, room))), (1, st.just(room))))
    name = leaf(draw, fault, "name", st.none() | st.text(max_size=6), b"kv", 5, [])
    keys = leaf(draw, fault, "rkeys", st.lists(u32, max_size=8), [0] * 8, [0] * 9, [-1], [1 << 32],
                [(1 << 32) - 1], "k", [None])
    item = [addr, length, draw(st.integers(0, 3)), name, keys]
    if fault.name == "shape":
        return pick(draw, fault, [item[:3], item + [[]], "item", item[:4]])    # item[:4] is allowed
    return item


@st.composite
def wire_regions(draw: st.DrawFn, fault: Fault = Fault()) -> list[Any]:
    first = [draw(wire_region(fault))] if fault.name else []
    return first + draw(st.lists(wire_region(), max_size=2))


@st.composite
def wire_rdma(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    n = pick(draw, fault, [0, 8, 9]) if fault.name == "devices" else draw(st.integers(1, 3))
    devices = []
    for i in range(n):
        f = fault if i == 0 else Fault()
        devices.append({
            "name": leaf(draw, f, "name", st.text(max_size=8), b"mlx5_0", None),
            "gid": leaf(draw, f, "gid", sized_bytes(16, 16), b"g" * 15, b"g" * 17, "g" * 16),
            "lid": leaf(draw, f, "lid", st.integers(0, 65535), "1", None, 1.0),
            "mtu": leaf(draw, f, "mtu", st.integers(1, 5), 0, 1, 5, 6, -1, 5.0, "5"),
            "link": "Ethernet", "port": 1,
            "up": leaf(draw, f, "up", st.booleans(), 1, 0, "true", None),
        })
    keys = leaf(draw, fault, "rkeys", st.lists(u32, min_size=n, max_size=n), [0] * (n + 1), [0] * (n - 1),
                [-1] * n, [1 << 32] * n, [(1 << 32) - 1] * n, None)
    probe = [leaf(draw, fault, "addr", addr64, 0, -1, 1, U64 - 1),
             keys, leaf(draw, fault, "cookie", sized_bytes(1, 64), b"", b"c" * 64, b"c" * 65, "c")]
    out: Any = {"devices": devices, "probe": probe}
    if fault.name == "shape":
        out = pick(draw, fault, [{"devices": devices}, {"probe": probe}, {**out, "probe": probe[:2]},
                                 {**out, "probe": probe + [1]}, [devices, probe], "rdma"])
    return out


@st.composite
def wire_descriptor(draw: st.DrawFn, fault: Fault = Fault()) -> Any:
    d = {
        "address": leaf(draw, fault, "address", st.text(max_size=12), b"a", None),
        "incarnation": leaf(draw, fault, "incarnation", st.integers(0, (1 << 63) - 1), True, 1.5, None, -1,
                            U64 - 1),
        "host": leaf(draw, fault, "host", st.text(max_size=12), b"h", 1),
        "pid": leaf(draw, fault, "pid", st.integers(1, 1 << 22), "1", False, 0),
        "process": leaf(draw, fault, "process", sized_bytes(16, 16), "p", None, b""),
        "probe": [draw(addr64), leaf(draw, fault, "cookie", sized_bytes(0, 64), b"", b"c" * 64, b"c" * 65, "c")],
        "data": leaf(draw, fault, "data", st.lists(st.tuples(st.text(max_size=9), st.integers(1, 65535)).map(list),
                                                   max_size=2),
                     [["h", 0]], [["h", 65535]], [["h", 65536]], [["h", "80"]], [[b"h", 1]], [["h"]], ["h", 1]),
        "generation": leaf(draw, fault, "generation", st.integers(0, 1 << 40), 1.0, None, -1),
        "regions": draw(wire_regions(fault.inner("region"))),
        "rdma": draw(wire_rdma(fault.inner("rdma"))) if fault.name.startswith("rdma.")
        else draw(st.none() | wire_rdma()),
    }
    if fault.name == "probe":
        a, c = d["probe"]
        d["probe"] = pick(draw, fault, [[0, c], [-1, c], [1, c], [U64 - 1, c], [None, c], [a], [a, c, 3], "p", {}])
    if fault.name == "missing":
        del d[pick(draw, fault, sorted(d))]
    return d


def faults(make: Any, names: list[str]) -> st.SearchStrategy:
    """Wire values with one fault (or none), the same with random damage
    (mutated), and junk."""
    one = st.sampled_from([""] + names).flatmap(lambda name: make(Fault(name)))
    return weighted((6, one), (2, make().flatmap(mutated)), (1, junk))


MESSAGE_TYPES = ["hello", "auth", "ping", "notify", "describe", "rdma_connect", "bye", "error", "challenge",
                 "welcome", "pong", "regions", ""]
SESSION_TYPES = ["ping", "notify", "describe", "rdma_connect", "bye"]
FIELDS = ["nonce", "address", "proof", "data", "rid", "qps", "replace", "descriptor", "token",
          "code", "message"]


@st.composite
def almost_messages(draw: st.DrawFn, types: list[str] = MESSAGE_TYPES) -> dict[str, Any]:
    """Messages meant as one of `types`, with the fields that type needs:
    mostly right, sometimes of the wrong type or size, missing, or joined
    by junk; the type itself sometimes another or junk."""
    meant = draw(st.sampled_from(types))
    msg: dict[str, Any] = {
        "v": draw(weighted((10, st.just(VERSION)), (1, junk))),
        "t": draw(weighted((8, st.just(meant)), (1, st.sampled_from(MESSAGE_TYPES)), (1, junk))),
    }
    if meant == "hello":
        msg["nonce"] = draw(weighted((12, st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES)),
                                     (1, sized_bytes(NONCE_BYTES - 1, NONCE_BYTES + 1)),
                                     (1, st.binary(max_size=40)), (1, junk)))
        msg["address"] = draw(weighted((6, st.just("fuzz:1")), (1, junk)))
        # (none from 0.05 s to 1 s: a session that idles out while the
        # exchange is still on the wire would make the replies depend on
        # timing; under 0.05 s the server ignores it)
        msg["keepalive"] = draw(st.sampled_from([None, -1, 0, 1e-9, 0.01, 5.0, 3600, 3601, float("inf"),
                                                 float("nan"), "5", True, [1]]))
    elif meant == "auth":
        msg["proof"] = draw(weighted((2, st.binary(min_size=32, max_size=32)), (1, junk)))
    elif meant == "notify":
        msg["data"] = draw(weighted((3, st.binary(max_size=40)), (1, junk)))
    elif meant == "rdma_connect":
        msg["qps"] = draw(st.lists(junk, max_size=3) | junk)
        msg["replace"] = draw(junk)
        msg["rid"] = draw(junk)
    if draw(st.integers(0, 9)) == 0:
        del msg[draw(st.sampled_from(sorted(msg, key=str)))]
    if draw(st.integers(0, 3)) == 0:
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=2)):
            msg[name] = draw(junk)
    return msg


def frame(body: bytes) -> bytes:
    return LEN.pack(len(body)) + body


def deep(depth: int) -> bytes:
    """msgpack of a rdma_connect whose rid nests `depth` arrays (msgpack's
    own limits are around 1024)."""
    head = msgpack.packb({"v": VERSION, "t": "rdma_connect", "qps": []})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("rid") + b"\x91" * depth + b"\xc0"


def frames_of(messages: list[Any]) -> bytes:
    return b"".join(frame(msgpack.packb(m)) for m in messages)
