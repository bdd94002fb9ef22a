"""Mooncake Store's unified parallelism API on kvflow (kvflow.compat.mooncake.
parallelism): the keys and bytes each shard is stored under, the manifests,
what each ReadTarget reads back, and the codes and exceptions of bad input.
Mooncake's own cases run in test_mooncake_ci.py (scripts/test_tensor_api.py)."""
from __future__ import annotations

import ctypes
import importlib.util
import struct
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from _store_master import ROOT, store_env  # noqa: E402
from kvflow.compat.mooncake import tensor as kt  # noqa: E402
from kvflow.compat.mooncake.parallelism import ParallelAxis, ReadTarget, TensorParallelism  # noqa: E402
from kvflow.compat.mooncake.shim import shim_path  # noqa: E402
from kvflow.compat.mooncake.store import MooncakeDistributedStore  # noqa: E402

INVALID = -600


@pytest.fixture(scope="module")
def master():
    p = subprocess.Popen([sys.executable, "-m", "kvflow.store", "master", "--listen", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT, env=store_env(), stdin=subprocess.DEVNULL)
    line = p.stdout.readline()
    assert "ready" in line, line
    yield line.split()[-1]
    p.terminate()
    p.wait(10)


@pytest.fixture
def store(master):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) == 0
    yield s
    s.remove_all(True)
    assert s.close() == 0


def tp(rank, size, split_dim):
    return ParallelAxis("tp", rank, size, split_dim)


def par(*axes):
    return TensorParallelism(list(axes))


def stored(store, key):
    """(metadata fields, the data's bytes) of the object under key."""
    raw = bytes(store.get_buffer(key))
    meta = kt.decode_metadata(raw, len(raw))
    assert meta is not None, key
    return meta, raw[meta["offset"]:]


def data(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def manifest(store, key):
    raw = bytes(store.get_buffer(key))
    assert len(raw) == 96
    magic, version, size, dtype, ndim, split_dim, count = struct.unpack_from("<IHHiiii", raw)
    assert (magic, version, size) == (0x574D414E, 1, 96)
    return dtype, list(struct.unpack_from(f"<{ndim}q", raw, 32)), split_dim, count


def test_request_types_as_the_binding_has_them():
    axis = ParallelAxis()
    assert (axis.kind, axis.rank, axis.size, axis.split_dim, axis.expert_id, axis.stage_id) == ("", 0, 1, None,
                                                                                                None, None)
    for field, bad in (("rank", "1"), ("size", 2.0), ("split_dim", "0"), ("expert_id", True), ("kind", 1)):
        with pytest.raises(TypeError):
            setattr(axis, field, bad)
    with pytest.raises(TypeError):
        TensorParallelism([{"kind": "tp"}])
    target = ReadTarget()
    assert target.mode == "as_stored" and target.parallelism is None
    target.mode = "FULL"
    assert target.mode == "full"
    with pytest.raises(RuntimeError, match="Unsupported ReadTarget mode"):
        target.mode = "all"
    with pytest.raises(TypeError):
        target.parallelism = [tp(0, 2, 0)]
    # the shim's mooncake.store exports them, as the wheel does
    spec = importlib.util.spec_from_file_location("shim_store", f"{shim_path()}/mooncake/store.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    assert shim.ParallelAxis is ParallelAxis and shim.ReadTarget is ReadTarget
    assert {"ParallelAxis", "TensorParallelism", "ReadTarget"} <= set(shim.__all__)


def test_single_tp_axis_stores_the_shard_it_is_given(store):
    full = torch.arange(4 * 12, dtype=torch.int32).reshape(4, 12)
    for rank, shard in enumerate(full.chunk(4, 1)):
        assert store.put_tensor_with_parallelism("w", shard.contiguous(), par(tp(rank, 4, 1))) == 0
    for rank, shard in enumerate(full.chunk(4, 1)):
        meta, payload = stored(store, f"w_tp_{rank}")       # put_tensor_with_tp's key
        assert meta["kind"] == kt.SHARD and meta["global_shape"] == [4, 12] and meta["local_shape"] == [4, 3]
        assert meta["axes"] == [(1, 0, rank, 4, 1, 0, 3)]     # TP, index 0, rank, count, split_dim, -, extent
        assert payload == data(shard)
    assert manifest(store, "w__parallelism_manifest") == (6, [4, 12], 1, 4)     # int32 is TensorDtype 6
    # the wrapper, the stored shard, the full tensor, and a shard of another TP size
    assert torch.equal(store.get_tensor_with_tp("w", tp_rank=2, tp_size=4), full.chunk(4, 1)[2])
    assert torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("shard", par(tp(1, 4, 1)))),
                       full.chunk(4, 1)[1])
    assert torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("full", par(tp(3, 4, 1)))), full)
    for rank in range(6):
        got = store.get_tensor_with_parallelism("w", ReadTarget("shard", par(tp(rank, 6, 1))))
        assert torch.equal(got, full.chunk(6, 1)[rank]), rank
    # 12 does not split into 5: no full tensor read as 5 shards, no slice cut;
    # a single TP axis then reads "<key>_tp_<rank>" as it is (Mooncake's
    # last resort, get_tensor_with_tp's key), which holds a 4-way shard here
    assert store.get_tensor_with_parallelism("w", ReadTarget("shard", par(tp(4, 5, 1)))) is None
    assert torch.equal(store.get_tensor_with_parallelism("w", ReadTarget("shard", par(tp(0, 5, 1)))),
                       full.chunk(4, 1)[0])
    assert store.get_tensor_with_parallelism("w", ReadTarget("full", par(tp(0, 5, 1)))) is None
    # a split_dim other than the stored one
    assert store.get_tensor_with_parallelism("w", ReadTarget("full", par(tp(0, 4, 0)))) is None


def test_multi_axis_writes_store_the_ranks_slice_under_canonical_keys(store):
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    pp = ParallelAxis("pp", 1, 2, stage_id=7)
    ep = ParallelAxis("ep", 0, 2, expert_id=11)
    for rank in range(2):
        # PP before TP in the request; the key puts them in DP, TP, EP, PP order
        assert store.put_tensor_with_parallelism("m", full, par(pp, tp(rank, 2, 0))) == 0
        meta, payload = stored(store, f"m__tp_{rank}of2_sd0__pp_1of2_sid7")
        assert meta["global_shape"] == [6, 8] and meta["local_shape"] == [3, 8]
        assert meta["axes"] == [(3, 0, 1, 2, -1, 7, 0), (1, 1, rank, 2, 0, 0, 3)]     # in the request's order
        assert payload == data(full.chunk(2, 0)[rank])
    assert manifest(store, "m__parallelism_manifest") == (0, [6, 8], 0, 2)
    # the axes in any order; the full tensor; a slice of another TP size
    assert torch.equal(store.get_tensor_with_parallelism("m", ReadTarget("shard", par(tp(1, 2, 0), pp))),
                       full.chunk(2, 0)[1])
    assert torch.equal(store.get_tensor_with_parallelism("m", ReadTarget("full", par(tp(0, 2, 0), pp))), full)
    assert torch.equal(store.get_tensor_with_parallelism("m", ReadTarget("shard", par(pp, tp(2, 3, 0)))),
                       full.chunk(3, 0)[2])
    # another stage is another shard set: nothing stored
    other = ParallelAxis("pp", 1, 2, stage_id=8)
    assert store.get_tensor_with_parallelism("m", ReadTarget("shard", par(other, tp(0, 2, 0)))) is None
    # no TP axis: the tensor as it is, under its axes' key
    assert store.put_tensor_with_parallelism("e", full, par(ep)) == 0
    meta, payload = stored(store, "e__ep_0of2_eid11")
    assert meta["axes"] == [(2, 0, 0, 2, -1, 11, 0)] and meta["local_shape"] == [6, 8] and payload == data(full)
    assert torch.equal(store.get_tensor_with_parallelism("e", ReadTarget("shard", par(ep))), full)
    assert store.get_tensor_with_parallelism("e", ReadTarget("full", par(ep))) is None   # full needs a TP axis


def test_writer_partitions_and_into_buffers(store):
    class Writer:
        def __init__(self, rank, size, split_dim):
            self.rank, self.size, self.split_dim = rank, size, split_dim

    full = torch.arange(8 * 6, dtype=torch.bfloat16).reshape(8, 6)
    assert store.batch_put_tensor_with_parallelism(["a", "b"], [full, full],
                                                   writer_partitions=[Writer(0, 3, 1), Writer(1, 2, 0)]) == [0, 0]
    for rank in (1, 2):
        assert store.put_tensor_with_parallelism("a", full, writer_partition=Writer(rank, 3, 1)) == 0
    assert store.put_tensor_with_parallelism("b", full, writer_partition=Writer(0, 2, 0)) == 0
    for rank in range(3):
        meta, payload = stored(store, f"a__writer_{rank}of3_sd1")
        assert meta["axes"] == [(1, 0, rank, 3, 1, 0, 2)] and payload == data(full.chunk(3, 1)[rank])
    assert manifest(store, "a__writer_manifest") == (12, [8, 6], 1, 3)          # bfloat16 is TensorDtype 12
    got = store.batch_get_tensor_with_parallelism(["a", "b"], [ReadTarget("full"), ReadTarget("full")])
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, full) for g in got)
    assert torch.equal(store.get_tensor_with_parallelism("a", ReadTarget("shard", par(tp(2, 3, 1)))),
                       full.chunk(3, 1)[2])
    # into registered memory: [TensorMetadata][data], the tensor a view of it
    size = kt.METADATA_SIZE + full.numel() * 2
    buf = (ctypes.c_ubyte * (2 * size))()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 2 * size) == 0
    try:
        got = store.batch_get_tensor_with_parallelism_into(["a", "b"], [ptr, ptr + size], [size, size],
                                                           [ReadTarget("full"), ReadTarget("full")])
        assert all(torch.equal(g, full) for g in got)
        meta = kt.decode_metadata(bytes(buf[:size]), size)
        assert meta["kind"] == kt.FULL and meta["global_shape"] == [8, 6] and bytes(buf[kt.METADATA_SIZE:size]) \
            == data(full)
        got[0][0, 0] = 5            # a view of the buffer
        assert ctypes.c_uint16.from_address(ptr + kt.METADATA_SIZE).value == 0x40A0
        shard = store.get_tensor_with_parallelism_into("a", ptr, size, ReadTarget("shard", par(tp(1, 3, 1))))
        assert torch.equal(shard, full.chunk(3, 1)[1])
        assert kt.decode_metadata(bytes(buf[:size]), kt.METADATA_SIZE + 16 * 2)["axes"] == [(1, 0, 1, 3, 1, 0, 2)]
        # writer shards are read whole or as they are: not re-cut to another size
        assert store.get_tensor_with_parallelism("a", ReadTarget("shard", par(tp(1, 2, 1)))) is None
        # too small for the object
        assert store.get_tensor_with_parallelism_into("a", ptr, size - 1, ReadTarget("full")) is None
    finally:
        assert store.unregister_buffer(ptr) == 0


def test_from_buffers_and_upserts(store):
    full = torch.arange(4 * 6, dtype=torch.int64).reshape(4, 6)
    meta, payload = kt.tensor_object(full)
    obj = meta + payload.numpy().tobytes()
    buf = ctypes.create_string_buffer(obj, len(obj))
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, len(obj)) == 0
    try:
        # a TP request from a buffer stores every rank's slice of it
        assert store.batch_put_tensor_with_parallelism_from(["f", "g"], [ptr, ptr], [len(obj)] * 2,
                                                            [par(tp(0, 3, 1)), None]) == [0, 0]
        for rank in range(3):
            m, p = stored(store, f"f_tp_{rank}")
            assert m["global_shape"] == [4, 6] and p == data(full.chunk(3, 1)[rank])
        assert torch.equal(store.get_tensor_with_parallelism("g"), full)
        assert store.put_tensor_with_parallelism_from("f", ptr, len(obj) - 1, par(tp(0, 3, 1))) == INVALID
    finally:
        assert store.unregister_buffer(ptr) == 0
    # put keeps a shard that exists; upsert replaces it
    assert store.put_tensor_with_parallelism("f", full.chunk(3, 1)[0].contiguous() + 100, par(tp(0, 3, 1))) == 0
    assert torch.equal(store.get_tensor_with_tp("f", tp_rank=0, tp_size=3), full.chunk(3, 1)[0])
    assert store.upsert_tensor_with_parallelism("f", full.chunk(3, 1)[0].contiguous() + 100, par(tp(0, 3, 1))) == 0
    assert torch.equal(store.get_tensor_with_tp("f", tp_rank=0, tp_size=3), full.chunk(3, 1)[0] + 100)
    assert store.batch_upsert_tensor_with_parallelism(["g"], [full * 2]) == [0]
    assert torch.equal(store.get_tensor("g"), full * 2)


def test_bad_requests_give_codes_or_none(store):
    t = torch.zeros(4, 6)
    w = type("W", (), {"rank": 0, "size": 2, "split_dim": 0})()
    bad_axes = [
        par(ParallelAxis("dp", 0, 2, split_dim=0)),             # DP takes no split_dim
        par(ParallelAxis("ep", 0, 2)),                          # EP needs expert_id
        par(ParallelAxis("pp", 0, 2)),                          # PP needs stage_id
        par(tp(0, 2, None)),                                    # TP needs split_dim
        par(tp(2, 2, 0)),                                       # rank out of range
        par(tp(0, 0, 0)),
        par(tp(0, 2, 0), tp(1, 2, 0)),                          # one axis per kind
        par(ParallelAxis("xp", 0, 2)),                          # no such kind
        par(),                                                  # no axes
        par(ParallelAxis("dp", 0, 2), tp(0, 4, 1)),             # 6 does not split into 4
        par(tp(0, 2, 2)),                                       # no dim 2
    ]
    for p in bad_axes:
        assert store.put_tensor_with_parallelism("bad", t, p) == INVALID, p
        assert store.get_tensor_with_parallelism("bad", ReadTarget("shard", p)) is None, p
    assert store.put_tensor_with_parallelism("bad", t, par(tp(0, 2, 0)), writer_partition=w) == INVALID
    assert store.put_tensor_with_parallelism("bad", [1, 2], par(tp(0, 2, 0))) == INVALID
    for rank, size, split_dim in ((0, 4, 1), (2, 2, 0), (0, 2, 5), (0, 0, 0)):
        w.rank, w.size, w.split_dim = rank, size, split_dim
        assert store.put_tensor_with_parallelism("bad", t, writer_partition=w) == INVALID
    assert store.put_tensor_with_parallelism("bad", t, writer_partition=object()) == INVALID
    assert store.batch_put_tensor_with_parallelism(["x", "y"], [t, t], [None, None], writer_partitions=[w, w]) \
        == [INVALID, INVALID]
    assert store.batch_put_tensor_with_parallelism(["x", "y"], [t, t], [None]) == [INVALID, INVALID]
    assert store.batch_put_tensor_with_parallelism(["x", "y"], [t], None) == [INVALID, INVALID]
    assert store.put_tensor_with_parallelism_from("bad", 0, 400, par(tp(0, 2, 0))) == INVALID
    assert store.batch_is_exist(["bad", "bad_tp_0", "x", "y"]) == [0, 0, 0, 0]      # nothing went in
    # reads: "as_stored" or "full" with axes that have no TP axis, a target
    # list of another length, a target that is not one
    assert store.put_tensor("plain", t) == 0
    assert store.get_tensor_with_parallelism("plain", ReadTarget("as_stored", par(tp(0, 1, 0)))) is None
    assert store.get_tensor_with_parallelism("plain", ReadTarget("full", par(ParallelAxis("dp", 0, 1)))) is None
    assert store.get_tensor_with_parallelism("plain", object()) is None
    assert torch.equal(store.get_tensor_with_parallelism("plain", ReadTarget("full")), t)   # no writer manifest
    assert store.batch_get_tensor_with_parallelism(["plain", "plain"], [ReadTarget()]) == [None, None]
    assert store.batch_get_tensor_with_parallelism_into(["plain"], [1, 2], [3]) == [None]
    for call in (lambda: store.put_tensor_with_parallelism(1, t), lambda: store.get_tensor_with_parallelism(1),
                 lambda: store.batch_put_tensor_with_parallelism([1], [t], [None])):
        with pytest.raises(TypeError):
            call()
