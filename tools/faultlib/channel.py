"""The JSON-line channel between the fault suite and its processes (and
the target's hash port), and the addresses and sizes both ends share."""
from __future__ import annotations

import asyncio
import json
from typing import Any




TARGET_PORT = 7400
REGION = 32 << 20
MARK = "@@FAULTS "
class TargetGone(RuntimeError):
    """The target process exited (killed by a fault case, or crashed)."""


async def ask_json_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: dict[str, Any],
                        timeout: float, *, gone: str, mark: bytes = b"") -> dict[str, Any]:
    """The protocol of this script's processes and the target's hash port:
    `request` as one JSON line, the answer one JSON line back (the first
    that starts with `mark`: a child's stdout carries other output too).
    Raises TargetGone(`gone`) when the other end closes first."""
    writer.write((json.dumps(request) + "\n").encode())
    await writer.drain()
    return await read_json_line(reader, timeout, gone=gone, mark=mark)


async def read_json_line(reader: asyncio.StreamReader, timeout: float, *, gone: str,
                         mark: bytes = b"") -> dict[str, Any]:
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if not line:
            raise TargetGone(gone)
        if line.startswith(mark):
            return json.loads(line[len(mark):])


class Hashes:
    """shas(): the target's SHA-256 of its region's ranges, asked by
    _ask (over a child's stdin/stdout, or the target's hash port)."""

    async def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        raise NotImplementedError

    async def shas(self, ranges: list[tuple[int, int]]) -> list[str]:
        return (await self._ask({"ranges": ranges}, 120))["shas"]
