"""Real metadata servers for the tests, each on a free loopback port and
owned by one test: redis-server, etcd, and Mooncake's HTTP metadata server
(run from its wheel). Under CI a missing one fails the test; elsewhere it
skips with the reason."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

BINARIES = {"redis": "redis-server", "etcd": "etcd"}
# Mooncake's HTTP metadata server (its wheel's mooncake/http_metadata_server.py,
# mooncake_http_metadata_server), run with this Python.
HTTP_SERVER = "mooncake.http_metadata_server"


def _http_server_missing() -> str | None:
    import importlib.util
    try:
        found = importlib.util.find_spec(HTTP_SERVER) is not None
    except ImportError:
        found = False
    return None if found else "Mooncake's HTTP metadata server is not installed (pip install " \
                              "mooncake-transfer-engine-non-cuda)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(why: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"metadata server unavailable under CI: {why}", pytrace=False)
    pytest.skip(why)


class MetadataServer:
    """A real redis-server, etcd or Mooncake HTTP metadata server on
    loopback, owned by one test."""

    def __init__(self, kind: str, workdir) -> None:
        self.kind = kind
        self.workdir = workdir
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"{self.kind}://127.0.0.1:{self.port}" + ("/metadata" if self.kind == "http" else "")

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"{self.kind}-{self.starts}.log", "wb")
        if self.kind == "redis":
            argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(self.workdir)]
        elif self.kind == "http":           # in memory: a restart starts empty
            argv = [sys.executable, "-m", HTTP_SERVER, "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "WARNING"]
        else:
            # A fresh data dir per start: a restart loses every key and lease,
            # as a server that restarts from scratch would. Short heartbeat and
            # election timeout: etcd's minimum lease TTL follows from them
            # (1.5 election timeouts), and the tests use 1 s leases.
            peer = f"http://127.0.0.1:{self.peer_port}"
            client = f"http://127.0.0.1:{self.port}"
            argv = ["etcd", "--name", "default", "--data-dir", str(self.workdir / f"etcd-{self.starts}"),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"default={peer}", "--heartbeat-interval", "10",
                    "--election-timeout", "100", "--log-level", "warn"]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 20
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = (self.workdir / f"{self.kind}-{self.starts}.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"{self.kind} did not come up on port {self.port}:\n{tail}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            if self.kind == "redis":
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            if self.kind == "http":
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metadata?key=up", timeout=1)
                except urllib.error.HTTPError as e:
                    return e.code == 404         # up, and the key unknown
                return True
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return json.load(r).get("health") == "true"
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(params=[*sorted(BINARIES), "http"])
def server(request, tmp_path):
    if request.param == "http":
        if (why := _http_server_missing()) is not None:
            _unavailable(why)
    elif shutil.which(BINARIES[request.param]) is None:
        _unavailable(f"{BINARIES[request.param]} is not installed (Debian: redis-server, etcd-server)")
    s = MetadataServer(request.param, tmp_path)
    s.start()
    yield s
    s.kill()


