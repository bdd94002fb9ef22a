"""kvflow's rdma provider against an independent verbs peer (pyverbs).

Both directions are checked with a peer that shares no data-path code with
kvflow: ``tests/_pyverbs_peer.py`` speaks the handshake protocol itself, gets
an RC queue pair from the engine's handshake server (``rdma_connect``), and
moves bytes with pyverbs' own RDMA READ / WRITE work requests.

* kvflow writes, pyverbs reads: engine A writes a scattered batch into engine
  B's region over rdma; the peer reads the range back and its SHA-256 must
  match the reference copy.
* pyverbs writes, kvflow reads: the peer writes a seeded pattern into B's
  region; A reads it back over rdma.

Around every range the region's other bytes hold a background pattern that
must survive, and the fixtures check the guard bytes around every registered
buffer. Runs only where there is an RDMA device (the Soft-RoCE VM:
``python3 tools/rdma_vm.py -- python3 -m pytest -m rdma tests/test_rdma_pyverbs.py``)
and where the system's python3-pyverbs imports into this interpreter.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from functools import lru_cache

import numpy as np
import pytest

from _batches import KiB, MiB, apply_entries, bounded, place, sha256, split
from _target import pattern

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pyverbs_peer.py")
SYSTEM_DIST = "/usr/lib/python3/dist-packages"
REGION = 4 * MiB
PEER_TIMEOUT = 120.0          # the peer is a fresh interpreter; under TCG that is slow


def _rdma_devices() -> list[str]:
    try:
        from kvflow.providers.rdma import provider as rdma
    except ImportError:
        return []
    return rdma.device_names()


@lru_cache(maxsize=None)
def _pyverbs_problem() -> str:
    """'' when pyverbs imports into this interpreter the way the peer does it."""
    code = f"import sys; sys.path.append({SYSTEM_DIST!r}); import pyverbs.device, pyverbs.qp, pyverbs.wr"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot check pyverbs: {e}"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"pyverbs ({SYSTEM_DIST}) does not import into {sys.executable}: {last}"
    return ""


def _skip_reason() -> str:
    if not _rdma_devices():
        return ("no RDMA device on this host (runs in the Soft-RoCE VM: "
                "python3 tools/rdma_vm.py -- python3 -m pytest -m rdma tests/test_rdma_pyverbs.py)")
    return _pyverbs_problem()


_SKIP = _skip_reason()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "-")]


async def run_peer(address: str, region: str, offset: int, length: int, *args: str, dump: str | None = None) -> dict:
    """Runs the pyverbs peer as a child (the event loop keeps serving the
    engine's handshake server meanwhile); returns its JSON report."""
    cmd = [sys.executable, PEER_SCRIPT, address, region, "--offset", str(offset), "--length", str(length),
           "--timeout", "60", *args]
    if dump:
        cmd += ["--dump", dump]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PEER_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(f"pyverbs peer did not finish in {PEER_TIMEOUT:g} s\nstdout: {out.decode(errors='replace')}\n"
                    f"stderr: {err.decode(errors='replace')}")
    text, etext = out.decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode == 0, (f"pyverbs peer failed (rc={proc.returncode}): {' '.join(cmd[1:])}\n"
                                  f"stdout: {text}\nstderr: {etext}")
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, f"pyverbs peer printed no report\nstdout: {text}\nstderr: {etext}"
    return json.loads(lines[-1])


def first_diff(a: np.ndarray, b: np.ndarray) -> str:
    bad = np.flatnonzero(a != b)
    if not len(bad):
        return "equal"
    return f"{len(bad)} bytes differ, first at {int(bad[0])}, last at {int(bad[-1])}"


def assert_outside_unchanged(buf: np.ndarray, background: np.ndarray, start: int, end: int, what: str) -> None:
    assert np.array_equal(buf[:start], background[:start]), \
        f"{what}: bytes before the range changed ({first_diff(buf[:start], background[:start])})"
    assert np.array_equal(buf[end:], background[end:]), \
        f"{what}: bytes after the range changed ({first_diff(buf[end:], background[end:])})"


async def rdma_setup(make_engine, local_mem, seed: int):
    """Engines A and B over rdma; B's region "kv" and a buffer of A, both
    filled with patterns (seed, seed + 1); A connected to B."""
    a = await make_engine(protocols=("rdma",))
    b = await make_engine(protocols=("rdma",))
    kv = local_mem(b, REGION, name="kv")
    background = pattern(seed, REGION)
    kv.view[:] = background
    mine = local_mem(a, REGION)
    mine_background = pattern(seed + 1, REGION)
    mine.view[:] = mine_background
    peer = await bounded(a.connect(b.address), 60)
    return a, b, kv, background, mine, mine_background, peer


async def test_kvflow_writes_pyverbs_reads(make_engine, local_mem, tmp_path):
    a, b, kv, background, src, _, peer = await rdma_setup(make_engine, local_mem, 101)
    assert peer.transport == "rdma"

    # The range [off, off + span) of "kv": a 4 KiB entry at each end of it,
    # one 1 MiB entry and ten more 4 KiB ones scattered (unaligned, random
    # order) in between; the gaps keep the background.
    rng = np.random.default_rng(7)
    off, span = 256 * KiB + 1234, 2 * MiB + 333
    inner = np.array([MiB] + [4 * KiB] * 10, np.uint64)
    inner_off = place(rng, inner, span - 8 * KiB) + np.uint64(4 * KiB)
    lengths = np.concatenate([np.array([4 * KiB], np.uint64), inner, np.array([4 * KiB], np.uint64)])
    roff = np.concatenate([np.array([0], np.uint64), inner_off, np.array([span - 4 * KiB], np.uint64)])
    order = rng.permutation(len(lengths))
    lengths, roff = lengths[order], roff[order] + np.uint64(off)
    soff = place(rng, lengths, REGION)

    await bounded(peer.write([src.addr + int(x) for x in soff], [kv.addr + int(x) for x in roff],
                             [int(n) for n in lengths]), 120)

    expected = background.copy()
    apply_entries(expected, roff, src.view, soff, lengths)
    assert np.array_equal(kv.view, expected), f"B's buffer after the rdma write: {first_diff(kv.view, expected)}"
    assert_outside_unchanged(kv.view, background, off, off + span, "B's region after the rdma write")

    dump = str(tmp_path / "read.bin")
    rep = await run_peer(b.address, "kv", off, span, "--read", dump=dump)
    got = np.fromfile(dump, dtype=np.uint8)
    want = expected[off:off + span]
    assert len(got) == span and np.array_equal(got, want), f"pyverbs read back: {first_diff(got, want)}"
    assert rep["sha256"] == sha256(want), rep
    assert rep["length"] == span and rep["work_requests"] >= 3, rep
    # the READ left B's memory alone
    assert np.array_equal(kv.view, expected), f"B's buffer after the pyverbs read: {first_diff(kv.view, expected)}"

    # kvflow's QPs still work after a foreign session came and went
    again = local_mem(a, 4 * KiB)
    await bounded(peer.read([again.addr], [kv.addr + off], [4 * KiB]), 60)
    assert np.array_equal(again.view, expected[off:off + 4 * KiB])


async def test_pyverbs_writes_kvflow_reads(make_engine, local_mem, tmp_path):
    # A's QPs exist while the foreign one writes
    a, b, kv, background, dst, dst_background, peer = await rdma_setup(make_engine, local_mem, 201)
    assert peer.transport == "rdma"

    seed, off, length = 4242, MiB + 777, 3 * MiB // 2 + 333
    want = pattern(seed, length)
    rep = await run_peer(b.address, "kv", off, length, "--write-seed", str(seed), "--chunk", str(256 * KiB))
    assert rep["sha256"] == sha256(want), rep
    assert rep["work_requests"] == -(-length // (256 * KiB)), rep

    # what landed in B, and nothing else
    assert np.array_equal(kv.view[off:off + length], want), \
        f"B's range after the pyverbs write: {first_diff(kv.view[off:off + length], want)}"
    assert_outside_unchanged(kv.view, background, off, off + length, "B's region after the pyverbs write")

    # A reads the range back in pieces (one of at least 1 MiB) into an unaligned spot of its buffer
    rng = np.random.default_rng(9)
    pieces = np.concatenate([split(rng, length - MiB, 7), np.array([MiB], np.uint64)])
    pieces = pieces[rng.permutation(len(pieces))]
    starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.uint64)
    doff = 12345
    await bounded(peer.read([dst.addr + doff + int(s) for s in starts], [kv.addr + off + int(s) for s in starts],
                            [int(n) for n in pieces]), 120)
    assert np.array_equal(dst.view[doff:doff + length], want), \
        f"A's buffer after the rdma read: {first_diff(dst.view[doff:doff + length], want)}"
    assert_outside_unchanged(dst.view, dst_background, doff, doff + length, "A's buffer after the rdma read")
    assert_outside_unchanged(kv.view, background, off, off + length, "B's region after the rdma read")
