"""The suite's reaper: a process of its own (its own session) that watches
the pytest process given on its command line and, once it is gone, kills
whatever it had started that is still running.

Why: a test that outlives its watchdog ends the run with os._exit
(faulthandler's exit=True), and a pytest killed for memory ends without
any cleanup; either way the servers its tests started (vLLM servers,
store masters, etcd, holders) lived on as orphans, held ports and memory,
and made the next runs fail for reasons of their own. The reaper learns
pytest's descendants by walking /proc every POLL_S (a process keeps its
place in the record by its start time, so a reused pid is never killed),
and kills the ones left once pytest is gone: those it saw reparented
away from pytest, too.

Usage (tests/conftest.py starts it): python tests/_reaper.py PYTEST_PID
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live process, or None (gone,
    or a zombie: pytest run by another process stays one until that one
    waits for it, which it may do only once the pipes it reads close, and
    the reaper holds pytest's stderr)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()     # after the command, which may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _descendants(root: int, procs: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def main(root: int) -> None:
    mine = os.getpid()
    start = _stat(root)
    if start is None:
        return
    seen: dict[int, int] = {}       # pid -> start time, every descendant of pytest seen alive
    while True:
        procs = _processes()
        st = procs.get(root)
        if st is None or st[1] != start[1]:
            break
        for pid in _descendants(root, procs) - {mine}:
            seen[pid] = procs[pid][1]
        # forget the ones that ended (a pid may be reused by anyone later)
        seen = {p: t for p, t in seen.items() if p in procs and procs[p][1] == t}
        time.sleep(POLL_S)
    procs = _processes()
    # the ones left, and whatever they started since the last look
    left = {p for p, t in seen.items() if p in procs and procs[p][1] == t}
    for p in list(left):
        left |= _descendants(p, procs)
    for pid in left - {mine}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        print(f"kvflow tests' reaper: killed {len(left)} processes pytest left behind", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]))
