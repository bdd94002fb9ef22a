"""Mooncake Store's tensor calls (put_tensor, get_tensor, their batch,
_into, _from, upsert and tensor-parallel forms, safetensors export and
import) on MooncakeDistributedStore's byte calls.

An object is Mooncake's: a 304-byte TensorMetadata, then the tensor's bytes
(C order), as mooncake-integration/integration_utils.h lays it out at the
pinned commit: a header (magic "MOON" 0x4d4f4f4e, version 1, header_size,
dtype as Mooncake's TensorDtype number, ndim, layout kind FULL or SHARD,
data_offset, data_bytes), then the global and local shapes (8 dims each,
-1 past ndim) and up to 4 layout axes. So a tensor put by kvflow reads on
Mooncake and the other way, field for field. A TP shard is stored under
"<key>_tp_<rank>" with layout SHARD, the full tensor's shape as global
shape and one TP axis (rank, count, split dim), as Mooncake stores it.

The unified parallelism calls (*_with_parallelism*) are parallelism.py's,
mixed in here (TensorCalls derives from ParallelismCalls).

torch is imported on the first tensor call, never at import. A tensor on a
GPU is copied to the host before it is stored (Mooncake reads device memory
in place); what comes back is a CPU tensor, as Mooncake's."""
from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any

from .codes import STORE_INVALID_PARAMS
from .parallelism import ParallelismCalls, tp_key

log = logging.getLogger("kvflow.compat.mooncake")

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1
AXIS_TP = 1
FILE_NOT_FOUND = -1100
_HEADER = struct.Struct("<IHHiiIIQQ")            # TensorObjectHeader, 40 bytes
_SHAPES = struct.Struct(f"<{MAX_DIMS}q{MAX_DIMS}qII")   # global, local, axis_count, reserved
_AXIS = struct.Struct("<iiiiiiq")                 # LayoutAxis, 32 bytes
METADATA_SIZE = _HEADER.size + _SHAPES.size + MAX_AXES * _AXIS.size     # sizeof(TensorMetadata) = 304
# Mooncake's TensorDtype numbers, in order
_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool",
           "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_SIZES = (4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1)


def _torch() -> Any:
    import torch
    return torch


def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.index(name) if name in _DTYPES else -1


def _shape(dims: list[int]) -> list[int]:
    return list(dims) + [-1] * (MAX_DIMS - len(dims))


def encode_metadata(dtype: int, global_shape: list[int], local_shape: list[int], data_bytes: int,
                    axes: list[tuple[int, ...]] = ()) -> bytes:
    """TensorMetadata's bytes; an axis is (kind, axis_index, rank, count,
    split_dim[, reserved0, reserved1]): Mooncake keeps an EP axis's
    expert_id or a PP axis's stage_id in reserved0 and the local extent of
    split_dim in reserved1, which is what a 5-field axis gets."""
    full = [tuple(a) if len(a) == 7 else (*a, 0, local_shape[a[4]] if 0 <= a[4] < len(local_shape) else 0)
            for a in axes]
    out = _HEADER.pack(MAGIC, VERSION, METADATA_SIZE, dtype, len(global_shape), SHARD if axes else FULL, 0,
                       METADATA_SIZE, data_bytes)
    out += _SHAPES.pack(*_shape(global_shape), *_shape(local_shape), len(axes), 0)
    out += b"".join(_AXIS.pack(*a) for a in full) + bytes(_AXIS.size * (MAX_AXES - len(axes)))
    return out


def decode_metadata(data: memoryview | bytes, total: int) -> dict | None:
    """The metadata's fields, or None when `data` is not a valid tensor
    object of `total` bytes (Mooncake's ValidateTensorMetadata)."""
    if total < METADATA_SIZE or len(data) < METADATA_SIZE:
        return None
    magic, version, hsize, dtype, ndim, kind, _, offset, nbytes = _HEADER.unpack_from(data, 0)
    shapes = _SHAPES.unpack_from(data, _HEADER.size)
    if (magic, version, hsize) != (MAGIC, VERSION, METADATA_SIZE) or not 0 <= dtype < len(_DTYPES):
        return None
    if not 0 <= ndim <= MAX_DIMS or kind > SHARD or not METADATA_SIZE <= offset <= total or nbytes != total - offset:
        return None
    global_shape, local_shape, axis_count = list(shapes[:ndim]), list(shapes[MAX_DIMS:MAX_DIMS + ndim]), shapes[16]
    if axis_count > MAX_AXES or min(global_shape + local_shape, default=0) < 0:
        return None
    numel = 1
    for d in local_shape:
        numel *= d
    if nbytes != numel * _SIZES[dtype]:
        return None
    axes = [_AXIS.unpack_from(data, _HEADER.size + _SHAPES.size + i * _AXIS.size) for i in range(axis_count)]
    return {"dtype": dtype, "global_shape": global_shape, "local_shape": local_shape, "offset": offset,
            "bytes": nbytes, "kind": kind, "axes": axes}


def tensor_object(tensor: Any, axes: list[tuple[int, int, int, int, int]] = (),
                  global_shape: list[int] | None = None) -> tuple[bytes, Any] | None:
    """(metadata, the tensor's bytes as a uint8 view) or None for what is
    not a storable tensor."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        return None
    dtype = _dtype_code(tensor.dtype)
    if dtype < 0 or tensor.dim() > MAX_DIMS:
        return None
    t = tensor.detach()
    t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
    data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    shape = list(t.shape)
    meta = encode_metadata(dtype, global_shape if global_shape is not None else shape, shape, t.numel() *
                           _SIZES[dtype], axes)
    return meta, data


def to_tensor(data: Any, total: int, *, copy: bool) -> Any:
    """The tensor an object's bytes hold (a view of `data` unless copy), or
    None when they are not a tensor object."""
    torch = _torch()
    view = memoryview(data).cast("B")[:total]
    meta = decode_metadata(view, total)
    if meta is None:
        log.debug("kvflow.compat.mooncake: not a tensor object (%d bytes)", total)
        return None
    dtype = getattr(torch, _DTYPES[meta["dtype"]])
    if meta["bytes"] == 0:
        return torch.empty(meta["local_shape"], dtype=dtype)
    payload = view[meta["offset"]:meta["offset"] + meta["bytes"]]
    flat = torch.frombuffer(bytearray(payload) if copy else payload, dtype=torch.uint8)
    return flat.view(dtype).reshape(meta["local_shape"])


def _at(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B") if size else memoryview(b"")


def shard(tensor: Any, rank: int, count: int, split_dim: int) -> Any:
    """Mooncake's uniform TP shard: None when the dim does not divide."""
    if not 0 <= split_dim < tensor.dim() or count <= 0 or not 0 <= rank < count:
        return None
    n = tensor.shape[split_dim]
    if n % count:
        return None
    return tensor.narrow(split_dim, rank * (n // count), n // count)


class TensorCalls(ParallelismCalls):
    """The tensor calls, mixed into MooncakeDistributedStore (which gives
    put_parts, upsert_parts, get_buffer, batch_get_buffer, get_into,
    batch_get_into, put_from, upsert_from, get_size, _fail)."""

    # ------------------------------------------------------------- put
    def _put_objects(self, keys: list[str], objs: list[tuple[bytes, Any] | None], config: Any,
                     upsert: bool) -> list[int]:
        """The funnel of every tensor put: the objects that are tensors go
        in one batch put (an upsert removes the old ones first, as
        upsert_batch does); per key 0 or a code."""
        from kvflow.errors import InvalidArgumentError
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise TypeError("keys must be a list of str")
        codes = [0] * len(keys)
        good = [i for i, o in enumerate(objs) if o is not None]
        for i in set(range(len(keys))) - set(good):
            codes[i] = self._fail(InvalidArgumentError(f"{keys[i]!r}: not a storable torch tensor"),
                                  STORE_INVALID_PARAMS)
        if not good:
            return codes
        names = [keys[i] for i in good]
        if upsert and (code := self._replace(names, config)) is not None:
            got = [code] * len(names)
        else:
            # metadata and bytes joined: one contiguous object per key
            values = [b"".join((objs[i][0], objs[i][1].numpy())) for i in good]
            got = self._puts(lambda c, kw: c.batch_put(names, values, **kw), len(names), config)
        for i, r in zip(good, got):
            codes[i] = r
        return codes

    def _put_tensors(self, keys: list[str], tensors: list[Any], config: Any, upsert: bool) -> list[int]:
        if not isinstance(tensors, (list, tuple)) or len(keys) != len(tensors):
            return self._fail_all(len(keys), "keys and tensors differ in length")
        return self._put_objects(keys, [tensor_object(t) for t in tensors], config, upsert)

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Stores a tensor (Mooncake's layout): 0 or a code."""
        return self._put_tensors([key], [tensor], None, False)[0]

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        return self._put_tensors([key], [tensor], config, False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensors([key], [tensor], None, True)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        return self._put_tensors([key], [tensor], config, True)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Stores each tensor, all in one batch put: per key 0 or a code."""
        return self._put_tensors(keys, tensors_list, None, False)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[Any], config: Any = None) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, None, True)

    def batch_upsert_pub_tensor(self, keys: list[str], tensors_list: list[Any], config: Any = None) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, True)

    def _check_from(self, buffer_ptr: int, size: int) -> int:
        if not buffer_ptr or size < METADATA_SIZE or decode_metadata(_at(buffer_ptr, size), size) is None:
            from kvflow.errors import InvalidArgumentError
            return self._fail(InvalidArgumentError("the buffer does not hold a tensor object "
                                                   "([TensorMetadata][data])"), STORE_INVALID_PARAMS)
        return 0

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Stores registered memory that holds [TensorMetadata][data] (as
        get_tensor_into leaves it): 0 or a code."""
        return self._check_from(buffer_ptr, size) or self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._check_from(buffer_ptr, size) or self.upsert_from(key, buffer_ptr, size)

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return self._fail_all(len(keys), "keys, buffer_ptrs and sizes differ in length")
        return [self.put_tensor_from(k, p, s) for k, p, s in zip(keys, buffer_ptrs, sizes)]

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return self._fail_all(len(keys), "keys, buffer_ptrs and sizes differ in length")
        return [self.upsert_tensor_from(k, p, s) for k, p, s in zip(keys, buffer_ptrs, sizes)]

    # ------------------------------------------------------------- get
    def get_tensor(self, key: str) -> Any:
        """The tensor stored under `key` (a CPU tensor), None when missing
        or not a tensor object."""
        h = self.get_buffer(key)
        return None if h is None else to_tensor(h, len(h), copy=False)

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        return [None if h is None else to_tensor(h, len(h), copy=False) for h in self.batch_get_buffer(keys)]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the object into registered memory at buffer_ptr; the tensor
        is a view of that memory (after the metadata). None on failure."""
        if not buffer_ptr:
            return None
        n = self.get_into(key, buffer_ptr, size)
        return None if n < 0 else to_tensor(_at(buffer_ptr, n), n, copy=False)

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[Any]:
        if not len(keys) == len(buffer_ptrs) == len(sizes) or not all(buffer_ptrs):
            return self._fail_all(len(keys), "keys, buffer_ptrs and sizes differ in length, or a pointer is null")
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [None if n < 0 else to_tensor(_at(p, n), n, copy=False) for p, n in zip(buffer_ptrs, got)]

    # ------------------------------------------------------------- tensor parallel
    def _put_tp(self, keys: list[str], tensors: list[Any], tp_size: int, split_dim: int, config: Any,
                upsert: bool) -> list[int]:
        """tp_size shards of each tensor under "<key>_tp_<rank>", every
        shard of every key in one batch put; per key 0 or the first code."""
        from kvflow.errors import InvalidArgumentError
        torch = _torch()
        if not isinstance(tensors, (list, tuple)) or len(keys) != len(tensors):
            return self._fail_all(len(keys), "keys and tensors differ in length")
        names: list[str] = []
        objs: list[Any] = []
        early: dict[int, int] = {}
        for i, (key, tensor) in enumerate(zip(keys, tensors)):
            if not isinstance(tensor, torch.Tensor):
                early[i] = self._fail(InvalidArgumentError(f"{key!r}: not a torch tensor"), STORE_INVALID_PARAMS)
                continue
            parts = [shard(tensor, rank, tp_size, split_dim) for rank in range(tp_size)]
            if any(p is None for p in parts):
                early[i] = self._fail(InvalidArgumentError(f"dim {split_dim} of {tuple(tensor.shape)} does not "
                                                           f"split into {tp_size} equal shards"), STORE_INVALID_PARAMS)
                continue
            for rank, part in enumerate(parts):
                names.append(tp_key(key, rank))
                objs.append(tensor_object(part, [(AXIS_TP, 0, rank, tp_size, split_dim)], list(tensor.shape)))
        got = iter(self._put_objects(names, objs, config, upsert) if names else [])
        out = []
        for i in range(len(keys)):
            if i in early:
                out.append(early[i])
            else:
                codes = [next(got) for _ in range(tp_size)]
                out.append(next((c for c in codes if c), 0))
        return out

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Stores each of tp_size shards of `tensor` (split along split_dim)
        under "<key>_tp_<rank>"; tp_size <= 1: put_tensor. 0 or a code."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._put_tp([key], [tensor], tp_size, split_dim, None, False)[0]

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Any = None, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._put_tp([key], [tensor], tp_size, split_dim, config, False)[0]

    def upsert_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                              split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.upsert_tensor(key, tensor)
        return self._put_tp([key], [tensor], tp_size, split_dim, None, True)[0]

    def batch_put_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any], tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, None, False)

    def batch_pub_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any], config: Any = None,
                                 tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, config, False)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        """This rank's shard ("<key>_tp_<tp_rank>"); tp_size <= 1: get_tensor."""
        return self.get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        return self.batch_get_tensor(base_keys if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> Any:
        return self.get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        keys = base_keys if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
                                split_dim: int = 0) -> int:
        """A full tensor object in registered memory, stored as tp_size
        shards (tp_size <= 1: put_tensor_from)."""
        if rc := self._check_from(buffer_ptr, size):
            return rc
        if tp_size <= 1:
            return self.put_from(key, buffer_ptr, size)
        return self._put_tp([key], [to_tensor(_at(buffer_ptr, size), size, copy=False)], tp_size, split_dim, None,
                            False)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                                      tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return self._fail_all(len(base_keys), "keys, buffer_ptrs and sizes differ in length")
        return [self.put_tensor_with_tp_from(k, p, s, tp_rank, tp_size, split_dim)
                for k, p, s in zip(base_keys, buffer_ptrs, sizes)]

    # ------------------------------------------------------------- safetensors
    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Writes the tensor under `key` to a safetensors file (named `key`
        by default): 0, -1100 when the key holds no tensor, -600 on failure."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return FILE_NOT_FOUND
        try:
            import safetensors.torch
            safetensors.torch.save_file({key: tensor.contiguous()}, key if file_name is None else file_name)
        except Exception as e:  # noqa: BLE001 - a code, as Mooncake
            return self._fail(e, STORE_INVALID_PARAMS)
        return 0

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Stores a tensor of a safetensors file under `key` (the file's
        tensor of that name, else its first; key None: the file name) and
        returns it; None on failure."""
        try:
            import safetensors.torch
            loaded = safetensors.torch.load_file(file_name)
        except Exception as e:  # noqa: BLE001 - None, as Mooncake
            self._fail(e, STORE_INVALID_PARAMS)
            return None
        if not loaded:
            return None
        target = file_name if key is None else key
        tensor = loaded[key] if key is not None and key in loaded else next(iter(loaded.values()))
        return tensor if self.put_tensor(target, tensor) == 0 else None
