"""The SSD tier's files: one file per object in a client's directory, its
own capacity and LRU, direct I/O where the filesystem takes it.

A file is a header block, then the object's bytes, padded to BLOCK:

    offset 0       magic "KVFSSD01", version, key length, size, payload crc32
                   (struct _HEAD), the key (UTF-8), crc32 of all that
    offset hdr     the object's `size` bytes (hdr = the header rounded up to
                   BLOCK, so the payload is aligned for O_DIRECT)

Visibility: a file is written under a temporary name, fsync'd, renamed to
its final name and the directory fsync'd; only then is it in the index
(and only then does the client tell the master it holds a copy). A crash
leaves either no final file or a complete one; temporary files are
deleted at adoption. Adoption (a restarted client) reads every final file
whole and checks both checksums: a torn or corrupt file is deleted, never
served. A read checks the header (the key and size it expects); the
payload's checksum is checked at adoption and, with `verify`, on every read
(zlib's crc32 runs at ~2 GB/s on one core here, about the disk's speed, so
checking each read would halve a get's throughput on a busy host).

Direct I/O: O_DIRECT bypasses the page cache, so a get reads the device
once and the cache is not filled with cold KV. Buffers and offsets are
BLOCK-aligned (anonymous mmaps are page-aligned). A filesystem that refuses
O_DIRECT (tmpfs: EINVAL at open) is detected once, at the directory's
probe, and the tier uses buffered I/O there (`direct` says which, and
`direct_reason` why not). A read lands straight in the caller's memory when
that memory is BLOCK-aligned (no bounce, no copy: the "no DRAM hop" path);
otherwise through an aligned bounce buffer and one copy.

Every call here blocks (file I/O): SsdTier's owner runs them on worker
threads. The index is touched only on the owner's loop thread.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from kvflow.errors import InvalidArgumentError

from .errors import StoreError
from .model import check_key

__all__ = ["BLOCK", "SsdFileError", "SsdTier", "file_name", "probe_direct", "read_object"]

BLOCK = 4096
MAGIC = b"KVFSSD01"
VERSION = 1
SUFFIX = ".kvo"
# magic, version, flags, key length, size, payload crc32
_HEAD = struct.Struct("<8sHHIQI")
_CRC = struct.Struct("<I")


class SsdFileError(StoreError):
    """An SSD file that is not the object it should be (torn, corrupt, another
    key or size): never served; its copy is dropped."""


def _round(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def file_name(key: str) -> str:
    """The file's path under the directory: keys are any str (up to 4 KiB),
    so the name is a hash; two levels keep a directory small."""
    h = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(h[:2], h[2:34] + SUFFIX)


def _header(key: str, size: int, crc: int) -> bytes:
    k = key.encode()
    head = _HEAD.pack(MAGIC, VERSION, 0, len(k), size, crc) + k
    return head + _CRC.pack(zlib.crc32(head))


def _parse_header(block: memoryview) -> tuple[str, int, int, int]:
    """(key, size, payload crc, payload offset) of a file's first bytes."""
    if len(block) < _HEAD.size:
        raise SsdFileError("file shorter than its header")
    magic, version, _flags, klen, size, crc = _HEAD.unpack_from(block)
    if magic != MAGIC or version != VERSION:
        raise SsdFileError("not a kvflow SSD object file (bad magic or version)")
    end = _HEAD.size + klen
    if end + 4 > len(block):
        raise SsdFileError("header longer than the file's first block(s)")
    if _CRC.unpack_from(block, end)[0] != zlib.crc32(block[:end]):
        raise SsdFileError("header checksum mismatch")
    return bytes(block[_HEAD.size:end]).decode(), size, crc, _round(end + 4)


def probe_direct(directory: str) -> tuple[bool, str]:
    """Whether files in `directory` may be opened with O_DIRECT (and read
    and written aligned). (True, "") or (False, why)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False, "this platform has no O_DIRECT"
    path = os.path.join(directory, f".probe-{uuid.uuid4().hex}")
    buf = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o600)
    except OSError as e:
        return False, f"the filesystem refuses O_DIRECT ({os.strerror(e.errno)}; tmpfs does)"
    try:
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        return True, ""
    except OSError as e:
        return False, f"O_DIRECT I/O failed ({os.strerror(e.errno)})"
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def _mem(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def read_object(path: str, key: str, size: int, parts: list[tuple[int, int]], *, direct: bool,
                verify: bool = False) -> None:
    """Reads the object `key` of `size` bytes from file `path` into `parts`
    ((address, length), filled in order). One preadv: the header block, the
    aligned body straight into the destination when it is one BLOCK-aligned
    part, the rest through a bounce. SsdFileError when the file is not that
    object; FileNotFoundError when it is gone."""
    hdr_len = _round(_HEAD.size + len(key.encode()) + 4)
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    try:
        head = mmap.mmap(-1, hdr_len)
        bounce = None
        try:
            a0, n0 = parts[0]
            if len(parts) == 1 and a0 % BLOCK == 0 and n0 >= size:
                body = size // BLOCK * BLOCK
                tail = _round(size - body)
                iov = [head] + ([_mem(a0, body)] if body else [])
                if tail:
                    bounce = mmap.mmap(-1, tail)
                    iov.append(bounce)
            else:
                body = 0
                tail = _round(size)
                bounce = mmap.mmap(-1, tail)
                iov = [head, bounce]
            got = os.preadv(fd, iov, 0)
            if got < hdr_len + size:
                raise SsdFileError(f"{path}: {got} bytes, a {size}-byte object needs {hdr_len + size}", key=key)
            fkey, fsize, crc, off = _parse_header(memoryview(head))
            if fkey != key or fsize != size or off != hdr_len:
                raise SsdFileError(f"{path} holds {fkey[:64]!r} ({fsize} bytes), not {key[:64]!r} ({size})",
                                   key=key)
            if body:
                if bounce is not None:
                    _mem(a0 + body, size - body)[:] = memoryview(bounce)[:size - body]
                if verify and zlib.crc32(memoryview(bounce)[:size - body] if bounce is not None else b"",
                                         zlib.crc32(_mem(a0, body))) != crc:
                    raise SsdFileError(f"{path}: payload checksum mismatch", key=key)
                return
            src = memoryview(bounce)
            if verify and zlib.crc32(src[:size]) != crc:
                raise SsdFileError(f"{path}: payload checksum mismatch", key=key)
            off = 0
            for a, n in parts:
                n = min(int(n), size - off)
                if n <= 0:
                    break
                _mem(int(a), n)[:] = src[off:off + n]
                off += n
        finally:
            # the mmaps are unmapped when the last view of them goes (close()
            # refuses while a memoryview of one is alive)
            del head, bounce
    finally:
        os.close(fd)


@dataclass(slots=True)
class Entry:
    size: int
    nbytes: int                 # the file's length on disk (header + padded payload)


class SsdTier:
    """One client's SSD directory: the index of the objects in it (LRU order),
    capacity, and the blocking file operations. `capacity`: bytes of files
    it may hold (headers and padding counted)."""

    def __init__(self, directory: str, capacity: int, *, direct: bool | None = None, verify: bool = False) -> None:
        if not isinstance(directory, str) or not directory:
            raise InvalidArgumentError(f"ssd_path must be a non-empty str, not {directory!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise InvalidArgumentError(f"ssd_capacity must be an int > 0, not {capacity!r}")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise InvalidArgumentError(f"ssd_path {directory!r}: {os.strerror(e.errno)}") from None
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"ssd_path {directory!r} is not a writable directory")
        self.directory = os.path.abspath(directory)
        self.capacity = capacity
        self.verify = verify
        can, why = probe_direct(self.directory)
        if direct and not can:
            raise InvalidArgumentError(f"direct I/O asked for in {directory!r}: {why}")
        self.direct = can if direct is None else bool(direct)
        # one tier per directory: two clients adopting the same files would
        # each evict and delete the other's (the lock goes with the process)
        self._lock_fd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise InvalidArgumentError(f"ssd_path {directory!r} is in use by another client") from None
        self.direct_reason = why
        self.index: OrderedDict[str, Entry] = OrderedDict()
        self.used = 0
        self.discarded = 0          # files dropped at adoption (torn, corrupt, temporary)

    def __repr__(self) -> str:
        return (f"<SsdTier {self.directory} {len(self.index)} objects {self.used}/{self.capacity} "
                f"{'direct' if self.direct else 'buffered'}>")

    def close(self) -> None:
        """Releases the directory (idempotent)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def path(self, key: str) -> str:
        return os.path.join(self.directory, file_name(key))

    @staticmethod
    def file_bytes(key: str, size: int) -> int:
        return _round(_HEAD.size + len(key.encode()) + 4) + _round(size)

    # -- index (the owner's loop thread) ---------------------------------------
    def make_room(self, nbytes: int) -> list[str]:
        """Takes least-recently-used entries out of the index until `nbytes`
        more fit; returns their keys (the caller deletes the files and tells
        the master). Nothing is taken if `nbytes` exceeds the capacity."""
        if nbytes > self.capacity:
            return []
        out = []
        while self.used + nbytes > self.capacity and self.index:
            key, e = self.index.popitem(last=False)
            self.used -= e.nbytes
            out.append(key)
        return out

    def add(self, key: str, size: int) -> None:
        old = self.index.pop(key, None)
        if old is not None:
            self.used -= old.nbytes
        e = self.index[key] = Entry(size, self.file_bytes(key, size))
        self.used += e.nbytes

    def forget(self, key: str) -> bool:
        e = self.index.pop(key, None)
        if e is None:
            return False
        self.used -= e.nbytes
        return True

    def touch(self, key: str) -> None:
        if key in self.index:
            self.index.move_to_end(key)

    # -- files (worker threads) ------------------------------------------------
    def write(self, key: str, src: int, size: int) -> None:
        """Writes `size` bytes at address `src` as the object `key`: temporary
        file, fsync, rename, directory fsync. Visible (to adoption and to
        readers of the final name) only once complete."""
        check_key(key)
        head = _header(key, size, zlib.crc32(_mem(src, size)))
        hdr_len = _round(len(head))
        total = hdr_len + _round(size)
        final = self.path(key)
        sub = os.path.dirname(final)
        os.makedirs(sub, exist_ok=True)
        tmp = os.path.join(sub, f".tmp-{uuid.uuid4().hex}")
        buf = mmap.mmap(-1, total)
        try:
            buf[:len(head)] = head
            memoryview(buf)[hdr_len:hdr_len + size] = _mem(src, size)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0), 0o600)
            try:
                done = 0
                while done < total:
                    done += os.pwrite(fd, memoryview(buf)[done:], done)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
        finally:
            del buf
        os.rename(tmp, final)
        _fsync_dir(sub)

    def read_into(self, key: str, size: int, parts: list[tuple[int, int]]) -> None:
        read_object(self.path(key), key, size, parts, direct=self.direct, verify=self.verify)

    def remove_file(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def scan(self) -> list[tuple[str, int]]:
        """Adoption: every final file read whole and checked (header and
        payload checksums, the name matching the key); bad and temporary
        files deleted. Returns (key, size) oldest first (by mtime) and fills
        the index in that order."""
        found = []
        for sub in sorted(os.listdir(self.directory)):
            d = os.path.join(self.directory, sub)
            if sub == ".lock":
                continue
            if sub.startswith(".probe-"):
                _unlink(d)
                continue
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                p = os.path.join(d, name)
                if not name.endswith(SUFFIX):
                    if name.startswith(".tmp-"):
                        _unlink(p)          # a write that never completed
                        self.discarded += 1
                    continue
                try:
                    key, size = self._check_file(p)
                    if file_name(key) != os.path.join(sub, name):
                        raise SsdFileError(f"{p} holds {key[:64]!r}, whose file is elsewhere")
                    found.append((os.stat(p).st_mtime_ns, key, size))
                except (SsdFileError, OSError, UnicodeDecodeError):
                    _unlink(p)
                    self.discarded += 1
        found.sort()
        out = []
        for _, key, size in found:
            self.add(key, size)
            out.append((key, size))
        return out

    def _check_file(self, path: str) -> tuple[str, int]:
        n = os.stat(path).st_size
        if n < BLOCK or n % BLOCK:
            raise SsdFileError(f"{path}: {n} bytes is not a whole file")
        with open(path, "rb", buffering=0) as f:
            data = f.read()
        view = memoryview(data)
        key, size, crc, off = _parse_header(view)
        if off + _round(size) != len(data):
            raise SsdFileError(f"{path}: {len(data)} bytes, its header says {off + _round(size)}")
        if zlib.crc32(view[off:off + size]) != crc:
            raise SsdFileError(f"{path}: payload checksum mismatch")
        return key, size


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:            # some filesystems refuse fsync of a directory
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        pass
