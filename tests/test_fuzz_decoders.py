"""Fuzzing (hypothesis) of the decoders that face the network, as functions:
``Descriptor.from_wire``, ``regions_from_wire``, ``rdma_from_wire``,
``read_message`` and rdma's ``accept`` return a checked value or raise
ProtocolError, nothing else. The shared rig and the whole picture:
tests/_fuzz_rig.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.errors import ProtocolError
from kvflow.control.wire import (
    VERSION,
    read_message,
)
from kvflow.control.descriptor import Descriptor, regions_from_wire
from kvflow.providers.rdma.part import rdma_from_wire
from _fuzz_rig import LEN, U64, fuzz_settings
from _fuzz_wire import (DESCRIPTOR_FAULTS, RDMA_FAULTS, REGION_FAULTS, Fault, almost_messages, check_rdma,
                        check_regions, faults, frame, good_descriptor_wire, junk, mutated, wire, wire_descriptor,
                        wire_rdma, wire_regions)


# ---------------------------------------------------------------- decoders as functions


def check_descriptor(d: Descriptor) -> None:
    for name in ("incarnation", "pid", "generation"):
        assert type(getattr(d, name)) is int
    assert isinstance(d.address, str) and isinstance(d.host, str) and isinstance(d.process, bytes)
    assert isinstance(d.probe_addr, int) and 0 < d.probe_addr < U64
    assert isinstance(d.probe_cookie, bytes) and len(d.probe_cookie) <= 64
    assert all(isinstance(h, str) and type(p) is int and 0 < p < 65536 for h, p in d.data)
    check_regions(d.regions)
    check_rdma(d.rdma)


# decoder, its checks of what it accepts, the wire values to feed it, their faults
DECODERS = {
    "descriptor": (Descriptor.from_wire, check_descriptor, wire_descriptor, DESCRIPTOR_FAULTS),
    "regions": (regions_from_wire, check_regions, wire_regions, REGION_FAULTS),
    "rdma": (rdma_from_wire, check_rdma, wire_rdma, RDMA_FAULTS),
}


def decode(name: str, value: Any) -> None:
    """The decoder returns a value that passes its checks, or raises
    ProtocolError; any other exception fails the test."""
    decoder, check, _, _ = DECODERS[name]
    try:
        out = decoder(wire(value))
    except ProtocolError:
        return
    check(out)


@fuzz_settings(150)
@given(faults(wire_descriptor, DESCRIPTOR_FAULTS))
def test_descriptor_from_wire(value):
    decode("descriptor", value)


@fuzz_settings(100)
@given(faults(wire_regions, REGION_FAULTS))
def test_regions_from_wire(value):
    decode("regions", value)


@fuzz_settings(100)
@given(faults(wire_rdma, RDMA_FAULTS))
def test_rdma_from_wire(value):
    decode("rdma", value)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_every_edge(name):
    """Every edge value of every checked leaf (the fuzz tests draw them at
    random), the rest of the value well formed and drawn by hypothesis."""
    _, _, make, faults_of = DECODERS[name]
    for fault in faults_of:
        for index in range(10):           # no leaf has more edge values
            @settings(max_examples=2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(make(Fault(fault, index)))
            def one(value):
                decode(name, value)

            one()


def test_descriptor_round_trip():
    d = Descriptor.from_wire(good_descriptor_wire())
    assert Descriptor.from_wire(wire(d.to_wire())) == d


@fuzz_settings(150)
@given(st.one_of(
    st.binary(max_size=200),
    st.builds(lambda body: LEN.pack(len(body)) + body, st.binary(max_size=200)),
    st.builds(lambda v: frame(msgpack.packb(v)), junk),
    st.builds(lambda m: frame(msgpack.packb(m)), st.deferred(lambda: almost_messages())),
))
async def test_read_message(data):
    """read_message returns a versioned message with a str type, or raises
    ProtocolError, or IncompleteReadError for a stream that ends early."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        msg = await read_message(reader, max_size=150)
    except (ProtocolError, asyncio.IncompleteReadError):
        return
    assert isinstance(msg, dict) and isinstance(msg["t"], str) and msg["v"] == VERSION


def _qp_entry() -> st.SearchStrategy:
    good = [0, 0x11, 0x22, b"g" * 16, 0, 5]
    return st.one_of(mutated(good), junk)


@fuzz_settings(100)
@given(st.fixed_dictionaries(
    {"t": st.just("rdma_connect")},
    optional={"qps": st.one_of(st.lists(_qp_entry(), max_size=4), junk),
              "replace": st.one_of(st.lists(st.one_of(st.lists(junk, min_size=2, max_size=2), junk), max_size=3),
                                   junk),
              "rid": junk}))
def test_rdma_accept_rejects_malformed(msg):
    """An authenticated peer's rdma_connect reaches RdmaProvider.on_control
    (kvflow/providers/rdma/provider.py) on an engine with rdma devices. Its checks run before
    any device is touched; with no device every QP entry is out of range,
    so the only outcome is ProtocolError (never TypeError and the like,
    which would escape the control session into the loop)."""
    from kvflow.providers.rdma.provider import RdmaProvider

    provider = RdmaProvider.__new__(RdmaProvider)      # the checks only, no devices
    provider.devices, provider._session_qps, provider._targets = [], {}, {}
    with pytest.raises(ProtocolError):
        provider.on_control("fuzz:1", object(), wire(msg))
