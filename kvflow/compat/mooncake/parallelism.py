"""Mooncake Store's unified parallelism API: ParallelAxis,
TensorParallelism and ReadTarget, and the *_with_parallelism* tensor calls
(put, upsert, their batch and _from forms; get, batch get and their _into
forms), on MooncakeDistributedStore's byte calls.

The storage layout is Mooncake's at the pinned commit
(mooncake-integration/store/store_py_internal.h, store_py_parallel_write.h,
store_py_parallel_read.h), so shards written by either read on the other:

- a shard is a tensor object (tensor.py) with layout SHARD and one layout
  axis per parallel axis (kind DP 0, TP 1, EP 2, PP 3; expert_id or
  stage_id in reserved0, the local extent of split_dim in reserved1);
- a single-TP-axis shard is stored under "<key>_tp_<rank>" (as
  put_tensor_with_tp); any other axis list under "<key>" plus, per axis in
  canonical order (DP, TP, EP, PP), "__<kind>_<rank>of<size>[_sd<d>]
  [_eid<e>][_sid<s>]";
- a writer_partition shard under "<key>__writer_<rank>of<size>_sd<d>";
- a TP write also stores a 96-byte manifest (magic "NAMW" 0x574d414e,
  the full tensor's dtype, shape, split_dim and shard count) under
  "<key>__parallelism_manifest" ("<key>__writer_manifest" for
  writer_partition), which is what a "full" read or a re-sharded "shard"
  read starts from.

What the API means (Mooncake's docs/source/design/store/
unified-parallel-tensor-io.md): a write with one TP axis stores the tensor
it is given as that rank's shard; a write with a TP axis and other axes, or
a writer_partition, is given the full tensor and stores the requested rank's
uniform slice; a write with no TP axis stores the tensor as it is under the
axes' key. A read says what it wants with ReadTarget.mode: "as_stored" (the
object under the key), "shard" (the requested shard: the stored one when
its axes match exactly, else cut from the reassembled tensor when a TP axis
says which slice) or "full" (the tensor reassembled from every stored
shard). Only uniform splits (the dim divides by the size) are supported, as
in Mooncake. Failures are Mooncake's: a write returns -600
(INVALID_PARAMS) or the store's code, a read returns None.

Reads fetch each shard object whole (batch_get_buffer) and join them on the
host; an _into read then copies [TensorMetadata][data] into the caller's
buffer, which must be large enough (kvflow does not check that the buffer
is registered: Mooncake fails an unregistered one)."""
from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any

from .codes import STORE_INVALID_PARAMS

log = logging.getLogger("kvflow.compat.mooncake")

KINDS = ("dp", "tp", "ep", "pp")             # LayoutAxisKind's numbers, in order
_CANONICAL = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
MODES = ("as_stored", "shard", "full")
MANIFEST_MAGIC = 0x574D414E
_MANIFEST_HEAD = struct.Struct("<IHHiiiii4x")       # WriterShardManifestHeader, padded to the shape's alignment
MAX_DIMS = 8                                    # Mooncake's kMaxTensorDims
_MANIFEST = struct.Struct(_MANIFEST_HEAD.format + f"{MAX_DIMS}q")   # + TensorShape: 96 bytes


# ----------------------------------------------------------------- request types
def _int(name: str, value: Any, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, not {type(value).__name__}")
    return value


class ParallelAxis:
    """One parallel axis of a shard's identity (Mooncake's ParallelAxis):
    kind "tp", "dp", "ep" or "pp"; rank and size; split_dim (TP only);
    expert_id (EP, required); stage_id (PP, required)."""

    __slots__ = ("_kind", "_rank", "_size", "_split_dim", "_expert_id", "_stage_id")

    def __init__(self, kind: str = "", rank: int = 0, size: int = 1, split_dim: int | None = None,
                 expert_id: int | None = None, stage_id: int | None = None) -> None:
        self.kind, self.rank, self.size = kind, rank, size
        self.split_dim, self.expert_id, self.stage_id = split_dim, expert_id, stage_id

    @property
    def kind(self) -> str:
        return self._kind

    @kind.setter
    def kind(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"kind must be a str, not {type(value).__name__}")
        self._kind = value

    rank = property(lambda self: self._rank, lambda self, v: setattr(self, "_rank", _int("rank", v)))
    size = property(lambda self: self._size, lambda self, v: setattr(self, "_size", _int("size", v)))
    split_dim = property(lambda self: self._split_dim,
                         lambda self, v: setattr(self, "_split_dim", _int("split_dim", v, True)))
    expert_id = property(lambda self: self._expert_id,
                         lambda self, v: setattr(self, "_expert_id", _int("expert_id", v, True)))
    stage_id = property(lambda self: self._stage_id,
                        lambda self, v: setattr(self, "_stage_id", _int("stage_id", v, True)))

    def __repr__(self) -> str:
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, split_dim={self.split_dim}, "
                f"expert_id={self.expert_id}, stage_id={self.stage_id})")


class TensorParallelism:
    """A shard's identity: its list of ParallelAxis (at most 4, one per kind)."""

    __slots__ = ("_axes",)

    def __init__(self, axes: list[ParallelAxis] | None = None) -> None:
        self.axes = [] if axes is None else axes

    @property
    def axes(self) -> list[ParallelAxis]:
        return self._axes

    @axes.setter
    def axes(self, value: list[ParallelAxis]) -> None:
        if not isinstance(value, (list, tuple)) or not all(isinstance(a, ParallelAxis) for a in value):
            raise TypeError("axes must be a list of ParallelAxis")
        self._axes = list(value)

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self.axes!r})"


class ReadTarget:
    """What a read wants: mode "as_stored", "shard" or "full" (any case),
    and for "shard" the requested shard's TensorParallelism."""

    __slots__ = ("_mode", "_parallelism")

    def __init__(self, mode: str = "as_stored", parallelism: TensorParallelism | None = None) -> None:
        self.mode, self.parallelism = mode, parallelism

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"mode must be a str, not {type(value).__name__}")
        if value.lower() not in MODES:
            raise RuntimeError("Unsupported ReadTarget mode")     # Mooncake's std::runtime_error
        self._mode = value.lower()

    @property
    def parallelism(self) -> TensorParallelism | None:
        return self._parallelism

    @parallelism.setter
    def parallelism(self, value: TensorParallelism | None) -> None:
        if value is not None and not isinstance(value, TensorParallelism):
            raise TypeError(f"parallelism must be a TensorParallelism or None, not {type(value).__name__}")
        self._parallelism = value

    def __repr__(self) -> str:
        return f"ReadTarget(mode={self.mode!r}, parallelism={self.parallelism!r})"


# ----------------------------------------------------------------- axes
class Axis(tuple):
    """A parsed axis: (kind, rank, size, split_dim, expert_id, stage_id)."""
    kind = property(lambda s: s[0])
    rank = property(lambda s: s[1])
    size = property(lambda s: s[2])
    split_dim = property(lambda s: s[3])

    def replace(self, **kw: int) -> Axis:
        fields = dict(zip(("kind", "rank", "size", "split_dim", "expert_id", "stage_id"), self))
        fields.update(kw)
        return Axis(fields.values())


def parse_parallelism(obj: Any) -> list[Axis] | str:
    """The axes of a TensorParallelism (duck-typed, as Mooncake reads it),
    or why it is not one."""
    try:
        axes = []
        for a in obj.axes:
            kind = a.kind.lower() if isinstance(a.kind, str) else None
            if kind not in KINDS:
                return f"unsupported parallel axis kind {a.kind!r}"
            vals = [a.rank, a.size, a.split_dim, a.expert_id, a.stage_id]
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in vals) or \
                    vals[0] is None or vals[1] is None:
                return "ParallelAxis fields must be ints"
            axes.append(Axis([kind, *vals]))
        return axes
    except (AttributeError, TypeError):
        return "a TensorParallelism must have axes of kind, rank, size, split_dim, expert_id and stage_id"


def validate(axes: list[Axis]) -> str | None:
    """Why Mooncake's validate_parallelism_spec refuses these axes, or None."""
    if not axes:
        return "parallelism axes cannot be empty"
    if len(axes) > kt.MAX_AXES:
        return "axis count exceeds max supported axes"
    if len({a.kind for a in axes}) != len(axes):
        return "duplicate axis kinds are not supported"
    for a in axes:
        if a.size <= 0 or not 0 <= a.rank < a.size:
            return f"invalid rank/size for axis {a.kind}"
        if a.kind == "tp" and a.split_dim is None:
            return "TP axis requires split_dim"
        if a.kind != "tp" and a.split_dim is not None:
            return f"{a.kind.upper()} axis must not provide split_dim"
        if a.kind == "ep" and a[4] is None:
            return "EP axis requires expert_id"
        if a.kind == "pp" and a[5] is None:
            return "PP axis requires stage_id"
    return None


def canonical(axes: list[Axis]) -> list[Axis]:
    return sorted(axes, key=lambda a: _CANONICAL[a.kind])


def tp_axis(axes: list[Axis]) -> Axis | None:
    return next((a for a in axes if a.kind == "tp"), None)


def with_tp(axes: list[Axis], **kw: int) -> list[Axis]:
    return [a.replace(**kw) if a.kind == "tp" else a for a in axes]


def tp_key(key: str, rank: int) -> str:
    """Where a TP rank's shard lives: the `*_with_tp` calls' key, and a
    single TP axis' (tensor.py uses it too)."""
    return f"{key}_tp_{rank}"


def shard_key(key: str, axes: list[Axis]) -> str:
    """Mooncake's get_parallelism_key_name."""
    if len(axes) == 1 and axes[0].kind == "tp":
        return tp_key(key, axes[0].rank)
    out = key
    for a in canonical(axes):
        out += f"__{a.kind}_{a.rank}of{a.size}"
        for tag, v in (("sd", a[3]), ("eid", a[4]), ("sid", a[5])):
            if v is not None:
                out += f"_{tag}{v}"
    return out


def writer_key(key: str, rank: int, size: int, split_dim: int) -> str:
    return f"{key}__writer_{rank}of{size}_sd{split_dim}"


def manifest_key(key: str, writer: bool) -> str:
    return f"{key}__writer_manifest" if writer else f"{key}__parallelism_manifest"


def layout_axes(axes: list[Axis], local_shape: list[int]) -> list[tuple[int, ...]]:
    """The LayoutAxis fields Mooncake stores for these axes, in their order."""
    out = []
    for i, a in enumerate(axes):
        tag = a[4] if a.kind == "ep" and a[4] is not None else a[5] if a.kind == "pp" and a[5] is not None else 0
        extent = local_shape[a.split_dim] if a.split_dim is not None else 0
        out.append((KINDS.index(a.kind), i, a.rank, a.size, -1 if a.split_dim is None else a.split_dim, tag, extent))
    return out


def stored_axes(meta: dict) -> list[Axis] | None:
    """The axes a SHARD object was stored with (parallelism_from_metadata), None for a FULL one."""
    if meta["kind"] != kt.SHARD:
        return None
    axes = []
    for kind, _, rank, count, split_dim, tag, _ in meta["axes"]:
        if not 0 <= kind < len(KINDS):
            return None
        k = KINDS[kind]
        axes.append(Axis([k, rank, count, split_dim if split_dim >= 0 else None, tag if k == "ep" else None,
                          tag if k == "pp" else None]))
    return axes


def same_axes(a: list[Axis], b: list[Axis], any_tp_rank: bool = False) -> bool:
    """The same axes, order aside (any_tp_rank: the TP axes' ranks may differ)."""
    if len(a) != len(b):
        return False
    ca, cb = canonical(a), canonical(b)
    if any_tp_rank:
        ca, cb = with_tp(ca, rank=0), with_tp(cb, rank=0)
    return ca == cb


def uniform(dim: int, count: int) -> bool:
    return dim >= 0 and count > 0 and dim % count == 0


def shard_range(dim: int, rank: int, count: int) -> tuple[int, int]:
    """(start, extent) of a rank's slice (Mooncake's calculate_shard_range)."""
    start = dim * rank // count
    return start, dim * (rank + 1) // count - start


# ----------------------------------------------------------------- manifest
def encode_manifest(dtype: int, shape: list[int], split_dim: int, count: int) -> bytes:
    return _MANIFEST.pack(MANIFEST_MAGIC, 1, _MANIFEST.size, dtype, len(shape), split_dim, count, 0,
                          *shape, *[-1] * (MAX_DIMS - len(shape)))


def decode_manifest(data: Any) -> tuple[int, list[int], int, int] | None:
    """(dtype, global shape, split_dim, shard count) or None when `data` is
    not a valid manifest."""
    if data is None or len(data) < _MANIFEST.size:
        return None
    magic, version, hsize, dtype, ndim, split_dim, count, _, *dims = _MANIFEST.unpack_from(data, 0)
    if (magic, version, hsize) != (MANIFEST_MAGIC, 1, _MANIFEST.size) or not 0 <= ndim <= MAX_DIMS or \
            count <= 0 or not 0 <= split_dim < ndim or min(dims[:ndim], default=0) < 0:
        return None
    return dtype, list(dims[:ndim]), split_dim, count


def _object(data: Any) -> tuple[dict, Any] | None:
    """(metadata, tensor) of a stored tensor object, None when it is not one."""
    if data is None:
        return None
    view = memoryview(data).cast("B")
    meta = kt.decode_metadata(view, len(data))
    if meta is None:
        return None
    meta["raw"] = bytes(view[:meta["offset"]])      # the stored metadata, for an _into read
    return meta, kt.to_tensor(data, len(data), copy=False)


def _shard_object(tensor: Any, axes: list[Axis], global_shape: list[int]) -> tuple[bytes, Any] | None:
    return kt.tensor_object(tensor, layout_axes(axes, list(tensor.shape)), global_shape)


def _readout(tensor: Any, axes: list[Axis] | None = None, global_shape: list[int] | None = None) -> tuple[bytes, Any]:
    """A read's answer: (the metadata an _into read writes, the tensor)."""
    meta = kt.tensor_object(tensor)[0] if axes is None else _shard_object(tensor, axes, global_shape)[0]
    return meta, tensor


class ParallelismCalls:
    """The *_with_parallelism* calls, mixed into MooncakeDistributedStore
    through TensorCalls (which gives _put_objects, put_tensor,
    get_tensor, get_tensor_into and the byte calls)."""

    # ------------------------------------------------------------- writes
    def _bad(self, why: str) -> int:
        from kvflow.errors import InvalidArgumentError
        return self._fail(InvalidArgumentError(why), STORE_INVALID_PARAMS)

    @staticmethod
    def _request(parallelism: Any) -> list[Axis] | str:
        """A write's axes, or why they are refused."""
        axes = parse_parallelism(parallelism)
        return axes if isinstance(axes, str) else validate(axes) or axes

    def _write_shard(self, name: str, obj: tuple[bytes, Any] | None, config: Any, upsert: bool,
                     manifest: tuple[str, bytes] | None = None) -> int:
        """One shard object, then its manifest: 0 or the first code."""
        if obj is None:
            return self._bad(f"{name!r}: not a storable torch tensor")
        if code := self._put_objects([name], [obj], config, upsert)[0]:
            return code
        if manifest is None:
            return 0
        return (self.upsert if upsert else self.put)(manifest[0], manifest[1], config)

    def _write_writer_partition(self, key: str, tensor: Any, writer: Any, config: Any, upsert: bool) -> int:
        """The full tensor's writer.rank slice under the writer key, with
        the writer manifest (build_writer_shard_tensor_info)."""
        try:
            rank, size, split_dim = writer.rank, writer.size, writer.split_dim
        except AttributeError:
            return self._bad("writer_partition must provide rank, size, and split_dim")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, size, split_dim)):
            return self._bad("writer_partition's rank, size and split_dim must be ints")
        if size <= 0 or not 0 <= rank < size or not 0 <= split_dim < tensor.dim() or \
                not uniform(tensor.shape[split_dim], size):
            return self._bad(f"invalid writer partition {rank}of{size} on dim {split_dim} of {tuple(tensor.shape)}")
        dtype = kt._dtype_code(tensor.dtype)
        start, extent = shard_range(tensor.shape[split_dim], rank, size)
        axes = [Axis(["tp", rank, size, split_dim, None, None])]
        obj = _shard_object(tensor.narrow(split_dim, start, extent), axes, list(tensor.shape))
        return self._write_shard(writer_key(key, rank, size, split_dim), obj, config, upsert,
                                 (manifest_key(key, True), encode_manifest(dtype, list(tensor.shape), split_dim, size)))

    def _write_parallel(self, key: str, tensor: Any, parallelism: Any, config: Any, writer: Any,
                        upsert: bool) -> int:
        """put_tensor_with_parallelism's routes (resolve_parallelism_write_request)."""
        torch = kt._torch()
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, not {type(key).__name__}")
        if writer is not None and parallelism is not None:
            return self._bad("writer_partition cannot be combined with parallelism")
        if not isinstance(tensor, torch.Tensor) or kt._dtype_code(tensor.dtype) < 0 or tensor.dim() > MAX_DIMS:
            return self._bad(f"{key!r}: not a storable torch tensor")
        if writer is not None:
            return self._write_writer_partition(key, tensor, writer, config, upsert)
        if parallelism is None:
            return self._put_tensors([key], [tensor], config, upsert)[0]
        axes = self._request(parallelism)
        if isinstance(axes, str):
            return self._bad(f"put_tensor_with_parallelism: {axes}")
        tp = tp_axis(axes)
        if tp is None:
            # no TP axis: the tensor as it is, tagged with its axes
            return self._write_shard(shard_key(key, axes), _shard_object(tensor, axes, list(tensor.shape)),
                                     config, upsert)
        if not tp.split_dim < tensor.dim():
            return self._bad(f"split_dim {tp.split_dim} is out of range for {tuple(tensor.shape)}")
        dtype = kt._dtype_code(tensor.dtype)
        if len(axes) == 1:
            # one TP axis: the tensor is the rank's shard; the full shape is inferred
            full = list(tensor.shape)
            full[tp.split_dim] *= tp.size
            shard = tensor
        else:
            # TP and other axes: the full tensor, of which the rank's slice is stored
            full = list(tensor.shape)
            if not uniform(full[tp.split_dim], tp.size):
                return self._bad(f"dim {tp.split_dim} of {tuple(full)} does not split into {tp.size} equal shards")
            shard = tensor.narrow(tp.split_dim, *shard_range(full[tp.split_dim], tp.rank, tp.size))
        return self._write_shard(shard_key(key, axes), _shard_object(shard, axes, full), config, upsert,
                                 (manifest_key(key, False), encode_manifest(dtype, full, tp.split_dim, tp.size)))

    def _write_parallel_from(self, key: str, buffer_ptr: int, size: int, parallelism: Any, config: Any,
                             writer: Any, upsert: bool) -> int:
        """put_tensor_with_parallelism_from's routes: the buffer holds a
        tensor object; a TP request stores every TP rank's slice of it
        (execute_tp_tensor_write_from_impl), without a manifest."""
        if writer is not None and parallelism is not None:
            return self._bad("writer_partition cannot be combined with parallelism")
        if not isinstance(buffer_ptr, int) or not isinstance(size, int) or not buffer_ptr or size < kt.METADATA_SIZE \
                or (meta := kt.decode_metadata(kt._at(buffer_ptr, size), size)) is None:
            return self._bad("the buffer does not hold a tensor object ([TensorMetadata][data])")
        if parallelism is None and writer is None:
            return (self.upsert_from if upsert else self.put_from)(key, buffer_ptr, size, config)
        tensor = kt.to_tensor(kt._at(buffer_ptr, size), size, copy=False)
        if writer is not None:
            return self._write_writer_partition(key, tensor, writer, config, upsert)
        axes = self._request(parallelism)
        if isinstance(axes, str):
            return self._bad(f"put_tensor_with_parallelism_from: {axes}")
        tp = tp_axis(axes)
        if tp is None:
            return self._write_shard(shard_key(key, axes), _shard_object(tensor, axes, meta["global_shape"]),
                                     config, upsert)
        if not tp.split_dim < tensor.dim() or not uniform(tensor.shape[tp.split_dim], tp.size):
            return self._bad(f"dim {tp.split_dim} of {tuple(tensor.shape)} does not split into {tp.size} equal shards")
        names, objs = [], []
        for rank in range(tp.size):
            rank_axes = with_tp(axes, rank=rank)
            part = tensor.narrow(tp.split_dim, *shard_range(tensor.shape[tp.split_dim], rank, tp.size))
            names.append(shard_key(key, rank_axes))
            objs.append(_shard_object(part, rank_axes, meta["global_shape"]))
        return next((c for c in self._put_objects(names, objs, config, upsert) if c), 0)

    def _write_batch(self, keys: list[str], n: int, parallelisms: Any, writers: Any, what: str,
                     direct: Any, each: Any) -> list[int]:
        """execute_batch_parallelism_write_requests: all fail on a bad
        request list; no requests: the plain batch call; else per key."""
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise TypeError("keys must be a list of str")
        if parallelisms is not None and writers is not None:
            return self._fail_all(len(keys), f"{what}: writer_partitions cannot be combined with parallelisms")
        if n != len(keys):
            return self._fail_all(len(keys), f"{what}: values and keys must have the same length")
        if parallelisms is None and writers is None:
            return direct()
        requests = parallelisms if parallelisms is not None else writers
        if not isinstance(requests, list) or len(requests) != len(keys):
            return self._fail_all(len(keys), f"{what}: keys and the requests must be lists of the same length")
        return [each(i, *((r, None) if parallelisms is not None else (None, r))) for i, r in enumerate(requests)]

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: TensorParallelism | None = None,
                                    config: Any = None, writer_partition: Any = None) -> int:
        """Stores a tensor as the shard `parallelism` (or writer_partition)
        names, or whole when neither is given: 0 or a code."""
        return self._write_parallel(key, tensor, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: TensorParallelism | None = None,
                                       config: Any = None, writer_partition: Any = None) -> int:
        return self._write_parallel(key, tensor, parallelism, config, writer_partition, True)

    def _batch_tensors(self, keys: list[str], tensors: list[Any], parallelisms: Any, config: Any, writers: Any,
                       upsert: bool) -> list[int]:
        return self._write_batch(
            keys, len(tensors), parallelisms, writers, "batch_put_tensor_with_parallelism",
            lambda: self._put_tensors(keys, tensors, config, upsert),
            lambda i, p, w: self._write_parallel(keys[i], tensors[i], p, config, w, upsert))

    def _batch_from(self, keys: list[str], ptrs: list[int], sizes: list[int], parallelisms: Any, config: Any,
                    writers: Any, upsert: bool) -> list[int]:
        if len(ptrs) != len(sizes):
            return self._fail_all(len(keys), "buffer_ptrs and sizes differ in length")
        def each(i: int, p: Any, w: Any) -> int:
            return self._write_parallel_from(keys[i], ptrs[i], sizes[i], p, config, w, upsert)
        return self._write_batch(keys, len(ptrs), parallelisms, writers, "batch_put_tensor_with_parallelism_from",
                                 lambda: [each(i, None, None) for i in range(len(keys))], each)

    def batch_put_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any], parallelisms: Any = None,
                                          config: Any = None, writer_partitions: Any = None) -> list[int]:
        """put_tensor_with_parallelism of each key (one batch put when
        neither request list is given): per key 0 or a code."""
        return self._batch_tensors(keys, tensors_list, parallelisms, config, writer_partitions, False)

    def batch_upsert_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any],
                                             parallelisms: Any = None, config: Any = None,
                                             writer_partitions: Any = None) -> list[int]:
        return self._batch_tensors(keys, tensors_list, parallelisms, config, writer_partitions, True)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: TensorParallelism | None = None, config: Any = None,
                                         writer_partition: Any = None) -> int:
        """As put_tensor_with_parallelism, the tensor object read from
        memory at buffer_ptr ([TensorMetadata][data])."""
        return self._write_parallel_from(key, buffer_ptr, size, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: TensorParallelism | None = None, config: Any = None,
                                            writer_partition: Any = None) -> int:
        return self._write_parallel_from(key, buffer_ptr, size, parallelism, config, writer_partition, True)

    def batch_put_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                               parallelisms: Any = None, config: Any = None,
                                               writer_partitions: Any = None) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, False)

    def batch_upsert_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                                  parallelisms: Any = None, config: Any = None,
                                                  writer_partitions: Any = None) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, True)

    # ------------------------------------------------------------- reads
    def _sources(self, names: list[str]) -> list[tuple[dict, Any]] | None:
        """Each name's stored tensor object, None when one is missing."""
        got = [_object(h) for h in self.batch_get_buffer(names)]
        return None if any(g is None for g in got) else got

    @staticmethod
    def _join(sources: list[tuple[dict, Any]], shape: list[int], split_dim: int, dtype: int) -> Any:
        """The full tensor from its uniform shards in rank order, None when
        they do not tile `shape` along split_dim."""
        torch = kt._torch()
        count = len(sources)
        for rank, (meta, t) in enumerate(sources):
            want = list(shape)
            want[split_dim] = shard_range(shape[split_dim], rank, count)[1]
            if meta["dtype"] != dtype or list(t.shape) != want:
                log.debug("kvflow.compat.mooncake: shard %d of %d is %s, not %s", rank, count, list(t.shape), want)
                return None
        return torch.cat([t for _, t in sources], dim=split_dim)

    def _full_from_manifest(self, key: str, axes: list[Axis]) -> tuple[Any, int] | None:
        """load_parallelism_manifest_reconstruction: the shards the manifest
        counts, with the request's other axes."""
        tp = tp_axis(axes)
        manifest = decode_manifest(self.get_buffer(manifest_key(key, False)))
        if manifest is None:
            return None
        dtype, shape, split_dim, count = manifest
        if tp.split_dim != split_dim or not uniform(shape[split_dim], tp.size) or not uniform(shape[split_dim], count):
            return None
        rank_axes = [with_tp(canonical(axes), rank=r, size=count) for r in range(count)]
        sources = self._sources([shard_key(key, a) for a in rank_axes])
        if sources is None:
            return None
        for a, (meta, _) in zip(rank_axes, sources):
            if (got := stored_axes(meta)) is None or not same_axes(a, got):
                return None
        return self._join(sources, shape, split_dim, dtype), dtype

    def _full_from_shards(self, key: str, axes: list[Axis]) -> tuple[Any, int] | None:
        """Without a manifest: a single TP axis reads the stored shard count
        off "<key>_tp_0"; more axes read the request's TP size of shards."""
        tp = tp_axis(axes)
        if len(axes) == 1:
            first = _object(self.get_buffer(key if tp.size <= 1 else f"{key}_tp_0"))
            stored = None if first is None else stored_axes(first[0])
            st = None if stored is None else tp_axis(stored)
            if st is None or st.split_dim != tp.split_dim:
                return None
            shape = first[0]["global_shape"]
            if not uniform(shape[st.split_dim], tp.size) or not uniform(shape[st.split_dim], st.size):
                return None
            rank_axes = [[st.replace(rank=r)] for r in range(st.size)]
            names = [key if st.size <= 1 else f"{key}_tp_{r}" for r in range(st.size)]
        else:
            rank_axes = [with_tp(canonical(axes), rank=r) for r in range(tp.size)]
            names = [shard_key(key, a) for a in rank_axes]
        sources = self._sources(names)
        if sources is None:
            return None
        for a, (meta, _) in zip(rank_axes, sources):
            got = stored_axes(meta)
            if got is None or not same_axes(a, got):
                return None
        meta = sources[0][0]
        return self._join(sources, meta["global_shape"], tp.split_dim, meta["dtype"]), meta["dtype"]

    def _full(self, key: str, axes: list[Axis]) -> tuple[Any, int] | None:
        got = self._full_from_manifest(key, axes) or self._full_from_shards(key, axes)
        return None if got is None or got[0] is None else got

    def _full_from_writer(self, key: str) -> tuple[bytes, Any] | None | bool:
        """The tensor from writer_partition shards; False when there is no
        writer manifest (the caller reads the key as stored)."""
        manifest = decode_manifest(self.get_buffer(manifest_key(key, True)))
        if manifest is None:
            return False
        dtype, shape, split_dim, count = manifest
        sources = self._sources([writer_key(key, r, count, split_dim) for r in range(count)])
        if sources is None:
            return None
        for r, (meta, _) in enumerate(sources):
            if stored_axes(meta) != [Axis(["tp", r, count, split_dim, None, None])]:
                return None
        full = self._join(sources, shape, split_dim, dtype)
        return None if full is None else _readout(full)

    def _read(self, key: str, target: Any) -> tuple[bytes, Any] | None | str:
        """The object a ReadTarget asks for as (metadata, tensor); None when
        it cannot be read; "as_stored" when it is the key's object as it
        is (get_tensor's path)."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, not {type(key).__name__}")
        if target is None:
            return "as_stored"
        try:
            mode, parallelism = target.mode, target.parallelism
        except AttributeError:
            log.error("kvflow.compat.mooncake: ReadTarget must provide mode and parallelism")
            return None
        mode = mode.lower() if isinstance(mode, str) else None
        axes = None if parallelism is None else parse_parallelism(parallelism)
        if mode not in MODES or isinstance(axes, str):
            log.error("kvflow.compat.mooncake: bad ReadTarget (%r, %s)", target.mode, axes)
            return None
        if axes is None and mode == "as_stored":
            return "as_stored"
        if axes is None and mode == "full":
            got = self._full_from_writer(key)
            return "as_stored" if got is False else got
        if axes is None or (why := validate(axes)) is not None:
            log.error("kvflow.compat.mooncake: get_tensor_with_parallelism: %s",
                      "parallelism is required" if axes is None else why)
            return None
        tp = tp_axis(axes)
        if mode == "shard":
            return self._read_shard(key, axes, tp)
        if mode == "full" and tp is not None:
            got = self._full(key, axes)
            return None if got is None else _readout(got[0])
        log.error("kvflow.compat.mooncake: get_tensor_with_parallelism: mode %r with %s needs a TP axis", mode, axes)
        return None

    def _read_shard(self, key: str, axes: list[Axis], tp: Axis | None) -> tuple[bytes, Any] | None:
        """The stored shard with exactly these axes (or, for one TP axis,
        the writer_partition shard); else, with a TP axis, the rank's slice
        of the reassembled tensor; else, for one TP axis, "<key>_tp_<rank>"."""
        names = [shard_key(key, axes)]
        if len(axes) == 1 and tp is not None:
            names.append(writer_key(key, tp.rank, tp.size, tp.split_dim))
        for name in names:
            got = _object(self.get_buffer(name))
            if got is not None and (stored := stored_axes(got[0])) is not None and same_axes(axes, stored):
                return got[0]["raw"], got[1]
        if tp is not None and (full := self._full(key, axes)) is not None:
            tensor, _ = full
            shape = list(tensor.shape)
            part = tensor.narrow(tp.split_dim, *shard_range(shape[tp.split_dim], tp.rank, tp.size))
            return _readout(part, axes, shape)
        if len(axes) == 1 and tp is not None:
            got = _object(self.get_buffer(key if tp.size <= 1 else names[0]))
            return None if got is None else (got[0]["raw"], got[1])
        log.error("kvflow.compat.mooncake: get_tensor_with_parallelism: parallelism metadata mismatch for key %r", key)
        return None

    def get_tensor_with_parallelism(self, key: str, target: ReadTarget | None = None) -> Any:
        """The tensor `target` asks for (a CPU tensor), None when it cannot
        be read: target None or "as_stored" is get_tensor."""
        got = self._read(key, target)
        if got == "as_stored":
            return self.get_tensor(key)
        return None if got is None else got[1]

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: list[Any] | None = None) -> list[Any]:
        if targets is None:
            return self.batch_get_tensor(keys)
        if not isinstance(targets, list) or len(targets) != len(keys):
            log.error("kvflow.compat.mooncake: batch_get_tensor_with_parallelism: keys and targets differ in length")
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: ReadTarget | None = None) -> Any:
        """As get_tensor_with_parallelism, the object ([TensorMetadata]
        [data]) written to memory at buffer_ptr; the tensor is a view of
        that memory. None when it cannot be read or does not fit."""
        got = self._read(key, target)
        if got == "as_stored":
            return self.get_tensor_into(key, buffer_ptr, size)
        if got is None or not isinstance(buffer_ptr, int) or not buffer_ptr:
            return None
        meta, tensor = got
        data = tensor.contiguous().reshape(-1).view(kt._torch().uint8).numpy() if tensor.numel() else b""
        total = len(meta) + len(data)
        if not isinstance(size, int) or total > size:
            log.error("kvflow.compat.mooncake: %r needs %d bytes, the buffer has %s", key, total, size)
            return None
        ctypes.memmove(buffer_ptr, meta, len(meta))
        if len(data):
            ctypes.memmove(buffer_ptr + len(meta), data.ctypes.data, len(data))
        return kt.to_tensor(kt._at(buffer_ptr, total), total, copy=False)

    def batch_get_tensor_with_parallelism_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                               targets: list[Any] | None = None) -> list[Any]:
        if not len(keys) == len(buffer_ptrs) == len(sizes) or \
                (targets is not None and (not isinstance(targets, list) or len(targets) != len(keys))):
            log.error("kvflow.compat.mooncake: batch_get_tensor_with_parallelism_into: "
                      "keys, buffer_ptrs, sizes and targets differ in length")
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, s, None if targets is None else targets[i])
                for i, (k, p, s) in enumerate(zip(keys, buffer_ptrs, sizes))]


# Last: tensor.py's TensorCalls derives from ParallelismCalls (so imports this
# module), and these calls use tensor.py's object layout only when called.
from . import tensor as kt  # noqa: E402

__all__ = ["ParallelAxis", "TensorParallelism", "ReadTarget", "ParallelismCalls"]
