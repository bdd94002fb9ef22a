"""vLLM's NixlConnector, worker side, on kvflow, byte for byte (issue 42, item 2 (a)).

Two vLLM 0.32 engines' connectors in two processes (tests/_vllm_worker.py, the
venv's python with kvflow's NIXL stand-in): a producer (prefill) and a consumer
(decode), each with the KV cache vLLM's model runner allocates for the tiny local
Llama (tests/_vllm_model.py: 2 layers, 2 KV heads of 64, float32, the layout the
connector asks for), filled with seeded random bytes, registered through
``register_kv_caches``; the handshake is vLLM's own (side channel served by the
scheduler-role connector, ``add_remote_agent`` on the stand-in); each request is
driven through ``start_load_kv`` / ``get_finished`` steps with the metadata vLLM's
scheduler side builds. Pull is vLLM's NixlConnector (the decode side READs),
push its NixlPushConnector (the decode side registers its blocks in a notification,
the prefill side WRITEs). Over kvflow's default providers (same host: process to
process) and over tcp.

Several requests move scattered, unordered blocks; then the whole KV storage of
both engines is compared with what it must hold: the consumer's blocks named by a
request are the producer's blocks for it, byte for byte, in every layer, and every
other byte of both storages is what it was before.
"""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import random

import numpy as np
import pytest

import _vllm

pytestmark = [pytest.mark.vllm]

MARK = "@@KVF@@"
WORKER = os.path.join(_vllm.TESTS_DIR, "_vllm_worker.py")
NUM_BLOCKS = 64
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _vllm.require_vllm()
    return _vllm.make_model(str(tmp_path_factory.mktemp("vllm") / "model"))


class Engine:
    """One _vllm_worker.py child."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: str):
        self.proc = proc
        self.log_path = log_path
        self._id = 0
        self._lock = asyncio.Lock()
        self.info: dict = {}

    @classmethod
    async def start(cls, tmp_path, model: str, role: str, mode: str, engine_id: str, seed: int,
                    protocols: str | None):
        # vLLM logs to stdout by default: to the log file with the rest, stdout is the protocol
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_vllm.free_port()), "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        if protocols:
            env["KVFLOW_NIXL_PROTOCOLS"] = protocols
        cfg = {"role": role, "mode": mode, "model": model, "engine_id": engine_id,
               "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "seed": seed}
        log_path = str(tmp_path / f"{role}.log")
        log = open(log_path, "wb")
        proc = await asyncio.create_subprocess_exec(
            _vllm.VENV_PY, WORKER, json.dumps(cfg), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=log, env=_vllm.child_env(**env), cwd=_vllm.ROOT,
            start_new_session=True)
        log.close()
        self = cls(proc, log_path)
        self.info = (await asyncio.wait_for(self._read(), 300))["ready"]
        return self

    def tail(self) -> str:
        with open(self.log_path, "rb") as f:
            lines = [ln for ln in f.read().decode(errors="replace").splitlines()
                     if "nanobind" not in ln and "leaked" not in ln]
        return "\n".join(lines[-40:])

    async def _read(self) -> dict:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                rc = await self.proc.wait()
                raise AssertionError(f"vLLM worker exited rc={rc}\n{self.tail()}")
            text = line.decode(errors="replace")
            if text.startswith(MARK):
                return json.loads(text[len(MARK):])

    async def op(self, op: str, timeout: float = 180, **args):
        async with self._lock:
            self._id += 1
            self.proc.stdin.write((json.dumps({"id": self._id, "op": op, "args": args}) + "\n").encode())
            await self.proc.stdin.drain()
            msg = await asyncio.wait_for(self._read(), timeout)
        assert msg.get("id") == self._id, msg
        if "error" in msg:
            raise AssertionError(f"{op} failed in the vLLM worker: {msg['error']}\n{self.tail()}")
        return msg["result"]

    async def dump(self, path) -> np.ndarray:
        await self.op("dump", path=str(path))
        return np.fromfile(str(path), dtype=np.uint8)

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.op("exit"), 30)
                await asyncio.wait_for(self.proc.wait(), 30)
            except (AssertionError, asyncio.TimeoutError, BrokenPipeError, ConnectionResetError):
                pass
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def _expected(before: np.ndarray, src: np.ndarray, layers: dict, moves: list[tuple[int, int]]) -> np.ndarray:
    out = before.copy()
    for g in layers.values():
        for s, d in moves:
            so, do, n = g["offset"] + s * g["block_stride"], g["offset"] + d * g["block_stride"], g["block_len"]
            out[do:do + n] = src[so:so + n]
    return out


@pytest.mark.parametrize("protocols", [None, "tcp"], ids=["default", "tcp"])
@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_vllm_nixl_connector_worker_side_moves_every_kv_byte(model, tmp_path, mode, protocols):
    # conftest's per-test watchdog (150 s) is short for two vLLM imports on a loaded 2-core host
    faulthandler.dump_traceback_later(600, exit=True)
    producer = consumer = None
    try:
        producer, consumer = await asyncio.gather(
            Engine.start(tmp_path, model, "kv_producer", mode, f"prefill-{mode}", 11, protocols),
            Engine.start(tmp_path, model, "kv_consumer", mode, f"decode-{mode}", 22, protocols))
        for e in (producer, consumer):
            assert e.info["nixl"].startswith(os.path.join(_vllm.ROOT, "kvflow", "compat", "nixl")), e.info
        layers = producer.info["layers"]
        assert layers == consumer.info["layers"] and len(layers) == 2
        for g in layers.values():
            # LBHNC: each layer's blocks [2 heads, 32 tokens, K|V 128 floats] one after another
            assert g["block_len"] == 2 * BLOCK_SIZE * 128 * 4 == g["block_stride"], g
        p0 = await producer.dump(tmp_path / "p0.bin")
        c0 = await consumer.dump(tmp_path / "c0.bin")
        assert not np.array_equal(p0, c0)

        rng = random.Random(f"{mode}-{protocols}")
        free_p, free_c = list(range(1, NUM_BLOCKS)), list(range(1, NUM_BLOCKS))   # block 0: vLLM's null block
        rng.shuffle(free_p)
        rng.shuffle(free_c)
        moves: list[tuple[int, int]] = []
        nreq = 0
        for n in (1, 5, 3, 12, 7):
            src = [free_p.pop() for _ in range(n)]
            dst = [free_c.pop() for _ in range(n)]
            suffix_p, suffix_c = f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08x}"
            req = f"cmpl-{mode}-{nreq}"
            p_req, c_req = f"{req}-{suffix_p}", f"{req}-{suffix_c}"   # as vLLM names them on each side
            info = producer.info
            remote = {"engine_id": info["engine_id"], "req": p_req, "host": info["side_host"],
                      "port": info["side_port"], "blocks": src}
            await producer.op("prefill", req=p_req)
            sent, got = await asyncio.gather(producer.op("send", req=p_req, blocks=src),
                                             consumer.op("recv", req=c_req, blocks=dst, remote=remote),
                                             return_exceptions=True)
            failed = [f"{side}: {r}" for side, r in (("producer", sent), ("consumer", got))
                      if isinstance(r, BaseException)]
            assert not failed, f"request {nreq} ({n} blocks): " + "\n\n".join(failed)
            assert sent["steps"] >= 1 and got["steps"] >= 1
            moves += list(zip(src, dst))
            nreq += 1

        p1 = await producer.dump(tmp_path / "p1.bin")
        c1 = await consumer.dump(tmp_path / "c1.bin")
        assert np.array_equal(p1, p0), "the producer's KV storage changed"
        want = _expected(c0, p0, layers, moves)
        if not np.array_equal(c1, want):
            bad = np.flatnonzero(c1 != want)
            raise AssertionError(f"{bad.size} consumer KV bytes differ from what the requests moved, "
                                 f"first at offset {bad[0]}")
        moved = len(moves) * sum(g["block_len"] for g in layers.values())
        assert moved == 28 * 2 * 32768
        stats = await (consumer if mode == "pull" else producer).op("stats")
        assert stats.get("num_failed_transfers", []) == [], stats
        _vllm.echo(f"{mode} over {protocols or 'default providers'}: {nreq} requests, {len(moves)} blocks, "
                   f"{moved} bytes, every byte of both KV storages as it must be")
    finally:
        for e in (consumer, producer):
            if e is not None:
                await e.close()
        faulthandler.cancel_dump_traceback_later()
