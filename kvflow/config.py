"""Every KVFLOW_* environment variable kvflow reads, read here and nowhere
else (tests/test_config.py checks that, and that docs/config.md lists
each one).

An engine argument always wins over its variable; a variable that is set
but malformed raises InvalidArgumentError naming it. Variables are read
when they are needed (an engine's construction or start), not at import,
so a process may set them before it makes its engines.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

from kvflow.errors import InvalidArgumentError

__all__ = ["VARIABLES", "Variable", "env_bool", "env_float", "env_int", "env_list", "env_str"]

T = TypeVar("T")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, what it sets, its default and
    the engine argument that overrides it (if any)."""

    name: str
    meaning: str
    default: str
    argument: str = ""


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("KVFLOW_SECRET", "shared secret every peer must prove (HMAC challenge-response); "
             "also kvflow-bench's and kvflow-info's", "none (no authentication)", "Engine(secret=)"),
    Variable("KVFLOW_KEEPALIVE", "seconds a peer's host may leave its connections unanswered (kernel ACKs and "
             "probes) before the peer is lost; a slow or stopped peer never is "
             "(0: never)", "5", "Engine(keepalive=)"),
    Variable("KVFLOW_LOCATION", "where registered memory lives (cpu, cpu:N, cuda:N): the NICs near it "
             "are preferred", "cpu", "Engine(location=)"),
    Variable("KVFLOW_TCP_RAILS", "comma-separated local addresses of the tcp rails, or auto",
             "one rail on the listen host", "Engine(rails=)"),
    Variable("KVFLOW_TCP_EXPRESS", "1: one more tcp connection per peer carries HIGH batches only; 0: none",
             "0", "Engine(tcp_express=)"),
    Variable("KVFLOW_TCP_BUSY_POLL", "seconds a tcp data connection's serving thread looks for the next frame "
             "before it sleeps; 0: at once", "0.00005", "Engine(tcp_busy_poll=)"),
    Variable("KVFLOW_TCP_CONGESTION", "the tcp data connections' congestion control: auto (a pacing one, BBR, "
             "becomes cubic within this host), system, or an algorithm name", "auto", "Engine(tcp_congestion=)"),
    Variable("KVFLOW_TOPOLOGY", "a JSON topology file overriding what discovery found", "none (sysfs)",
             "Topology.load()"),
    Variable("KVFLOW_RDMA_DEVICES", "comma-separated RDMA devices to use", "all", "Engine(rdma_devices=)"),
    Variable("KVFLOW_GID_INDEX", "GID index on every RDMA device", "a RoCE v2 IPv4-mapped GID",
             "Engine(rdma_gid_index=)"),
    Variable("KVFLOW_RDMA_ACK_TIMEOUT", "RC ACK timeout exponent, 1..31 (4.096 us * 2^n)",
             "14 on hardware NICs, 17 on software devices (rxe, siw)", "Engine(rdma_ack_timeout=)"),
    Variable("KVFLOW_RDMA_WORKER_POSTS", "1: each device's worker posts unpolled batches; 0: the "
             "submitting thread does", "1 on software devices, 0 on NICs"),
    Variable("KVFLOW_RDMA_SPIN_NS", "nanoseconds a device's worker spins for work on the wire before it "
             "sleeps", "200000"),
    Variable("KVFLOW_NIXL_HOST", "the address kvflow.compat.nixl agents' engines listen on and publish in "
             "their metadata (set one other hosts reach)", "127.0.0.1"),
    Variable("KVFLOW_STORE_MASTER", "the kvflow.store master kvflow's SGLang HiCache backend joins "
             "(host:port, a comma list, or etcd://host:port/cluster) when its extra config names none",
             "none (an embedded master)"),
    Variable("KVFLOW_STORE_SPIN_US", "microseconds a kvflow.store call on the caller's own thread (the Mooncake "
             "API's) polls for the master's reply before it sleeps in recv; 0: at once", "200"),
    Variable("KVFLOW_STORE_SHM", "1: kvflow.store segments in shared memory, mapped by same-host readers of the "
             "same user (clients whose engine picks its transports); 0: private memory", "0"),
    Variable("KVFLOW_SSD_OFFLOAD", "what the Mooncake API's SSD offload (enable_ssd_offload) copies to "
             "disk: eager (every object put, as Mooncake) or evict (those nearest eviction)", "eager"),
    Variable("KVFLOW_NIXL_PROTOCOLS", "comma-separated kvflow providers kvflow.compat.nixl agents may use "
             "(local, rdma, tcp)", "all (kvflow picks per peer)"),
)}


def _raw(name: str) -> str | None:
    assert name in VARIABLES, f"{name} is not in kvflow.config.VARIABLES"
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def env_str(name: str) -> str | None:
    """The variable's value, None when unset or empty."""
    return _raw(name)


def env_list(name: str) -> list[str] | None:
    """A comma-separated variable as a list (blanks dropped), None when unset."""
    value = _raw(name)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()] or None


def _parsed(name: str, parse: Callable[[str], T], what: str) -> T | None:
    value = _raw(name)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not {what}") from None


def env_float(name: str) -> float | None:
    return _parsed(name, float, "a number")


def env_int(name: str) -> int | None:
    return _parsed(name, int, "a whole number")


def env_bool(name: str) -> bool | None:
    """0 or 1; None when unset."""
    value = _raw(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise InvalidArgumentError(f"{name}={value!r} is not 0 or 1")
    return value == "1"
