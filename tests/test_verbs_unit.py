"""Pieces of the rdma provider that need no device: GID choice, descriptor
parsing of the rdma section, and errors naming the device and verbs status."""
from __future__ import annotations

import pytest

import kvflow
from kvflow.providers.rdma.part import rdma_from_wire
from kvflow.errors import ProtocolError, RemoteAccessError
from kvflow.status import status_error

verbs = pytest.importorskip("kvflow._verbs", reason="kvflow built without libibverbs")

ZERO = bytes(16)
LINK_LOCAL = bytes.fromhex("fe800000000000000200aafffe000001")
MAPPED = bytes(10) + b"\xff\xff" + bytes([198, 18, 0, 1])
GLOBAL6 = bytes.fromhex("20010db8000000000000000000000001")


def test_gid_choice_skips_link_local_and_zero():
    # no sysfs type information for this made-up device: prefer IPv4-mapped
    assert verbs.choose_gid("nodev", 1, [LINK_LOCAL, ZERO, GLOBAL6, MAPPED], 2) == 3
    assert verbs.choose_gid("nodev", 1, [LINK_LOCAL, GLOBAL6], 2) == 1
    assert verbs.choose_gid("nodev", 1, [LINK_LOCAL, ZERO], 2) == -1
    # InfiniBand link layer: index 0 (addressed by LID)
    assert verbs.choose_gid("nodev", 1, [GLOBAL6, MAPPED], 1) == 0


def test_rdma_section_of_descriptor_is_checked():
    good = {"devices": [{"name": "rxe0", "gid": MAPPED, "lid": 0, "mtu": 5, "link": 2, "port": 1}],
            "probe": [4096, [7], b"x" * 16]}
    assert rdma_from_wire(good)["devices"][0]["name"] == "rxe0"
    assert rdma_from_wire(None) is None
    for bad in ({}, {"devices": [], "probe": [4096, [], b"x"]},
                {**good, "probe": [4096, [7, 8], b"x"]},
                {**good, "devices": [{**good["devices"][0], "gid": b"short"}]},
                {**good, "devices": [{**good["devices"][0], "mtu": 9}]},
                {**good, "probe": [0, [7], b"x"]}, "garbage"):
        with pytest.raises(ProtocolError):
            rdma_from_wire(bad)


def test_verbs_error_names_device_and_status():
    # what a failed completion carries: status | wc_status << 8 | (device + 1) << 16
    err = status_error(3 | (10 << 8) | (1 << 16), peer="p:1", index=4, op=0, devices=["rxe0"])
    assert isinstance(err, RemoteAccessError)
    assert "rxe0" in str(err) and "IBV_WC_REM_ACCESS_ERR" in str(err) and "entry 4" in str(err)


def test_features_report_verbs():
    assert kvflow.features["verbs"] and kvflow.features["rdma"]


def test_ack_timeout_is_chosen_per_device(tmp_path, monkeypatch):
    """14 (67 ms) for a device with a parent in sysfs (a hardware NIC), 17
    (537 ms) for one without (rxe, siw: late emulated ACKs); the Engine
    option, then env KVFLOW_RDMA_ACK_TIMEOUT, override both; outside 1..31
    is an InvalidArgumentError."""
    from kvflow.providers.rdma import provider as rdma
    monkeypatch.delenv("KVFLOW_RDMA_ACK_TIMEOUT", raising=False)
    (tmp_path / "mlx5_0" / "device").mkdir(parents=True)
    (tmp_path / "rxe0").mkdir()
    assert rdma.choose_ack_timeout("mlx5_0", sysfs=str(tmp_path)) == 14
    assert rdma.choose_ack_timeout("rxe0", sysfs=str(tmp_path)) == 17
    assert rdma.choose_ack_timeout("rxe0", 20, sysfs=str(tmp_path)) == 20
    monkeypatch.setenv("KVFLOW_RDMA_ACK_TIMEOUT", "16")
    assert rdma.choose_ack_timeout("mlx5_0", sysfs=str(tmp_path)) == 16
    assert rdma.choose_ack_timeout("mlx5_0", 12, sysfs=str(tmp_path)) == 12     # the option wins
    for bad in ("0", "32", "x", "-1"):
        monkeypatch.setenv("KVFLOW_RDMA_ACK_TIMEOUT", bad)
        with pytest.raises(kvflow.InvalidArgumentError):
            rdma.choose_ack_timeout("rxe0", sysfs=str(tmp_path))
    monkeypatch.delenv("KVFLOW_RDMA_ACK_TIMEOUT")
    for bad in (0, 32, True, 1.5, "17"):
        with pytest.raises(kvflow.InvalidArgumentError):
            rdma.choose_ack_timeout("rxe0", bad, sysfs=str(tmp_path))
        with pytest.raises(kvflow.InvalidArgumentError):
            kvflow.Engine(rdma_ack_timeout=bad)


def test_worker_posts_on_software_devices_only(tmp_path, monkeypatch):
    """A software device's worker posts unpolled batches (its post does the
    transfer inside the system call); a NIC's submitting thread posts
    itself. KVFLOW_RDMA_WORKER_POSTS=0/1 decides for every device; anything
    else is an InvalidArgumentError."""
    from kvflow.providers.rdma import provider as rdma
    monkeypatch.delenv("KVFLOW_RDMA_WORKER_POSTS", raising=False)
    (tmp_path / "mlx5_0" / "device").mkdir(parents=True)
    (tmp_path / "rxe0").mkdir()
    assert rdma.choose_worker_posts("rxe0", sysfs=str(tmp_path)) is True
    assert rdma.choose_worker_posts("mlx5_0", sysfs=str(tmp_path)) is False
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv("KVFLOW_RDMA_WORKER_POSTS", env)
        assert rdma.choose_worker_posts("rxe0", sysfs=str(tmp_path)) is want
        assert rdma.choose_worker_posts("mlx5_0", sysfs=str(tmp_path)) is want
    for bad in ("yes", "2", " 1"):
        monkeypatch.setenv("KVFLOW_RDMA_WORKER_POSTS", bad)
        with pytest.raises(kvflow.InvalidArgumentError):
            rdma.choose_worker_posts("rxe0", sysfs=str(tmp_path))


def test_the_rdma_part_is_the_providers_own():
    """The descriptor carries rdma's part under "rdma" on the wire (as
    before), decoded by the rdma package's registered decoder; control/
    has no decoder of a provider's part of its own, refuses a part that
    would shadow one of its fields, and leaves out a part that no imported
    provider registered."""
    from kvflow.control import descriptor as d

    assert d._PARTS["rdma"] is rdma_from_wire
    part = {"devices": [{"name": "rxe0", "gid": bytes(16), "lid": 0, "mtu": 3}], "probe": [4096, [7], b"c"]}
    desc = d.Descriptor(address="h:1", incarnation=1, host="h", pid=1, process=b"p", probe_addr=4096,
                        probe_cookie=b"c", data=[("h", 2)], regions=[], generation=0, providers={"rdma": part})
    wire = desc.to_wire()
    assert wire["rdma"] is part and "providers" not in wire
    back = d.Descriptor.from_wire({**wire, "unknown_provider": {"x": 1}})
    assert back.rdma == part and back.providers == {"rdma": part}
    with pytest.raises(ProtocolError):
        d.Descriptor.from_wire({**wire, "rdma": {"devices": [], "probe": [0, [], b""]}})
    with pytest.raises(ValueError):
        d.register_part("regions", lambda v: v)
    assert d.parts_from_wire({"t": "regions", "regions": []}) == {}
