"""A soak's result: the invariants it checks (problems()), its table and JSON."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from soaklib.base import ABORT_MAX_PIECES, FD_MARGIN, KEEPALIVE, OPERATIONS, RSS_SLOPE_LIMIT
from soaklib.tally import Tally
from soaklib.monitor import Monitors, warning_kind


# ---------------------------------------------------------------------- soak
@dataclass
class SoakResult:
    seconds: float
    seed: int
    wall_s: float = 0.0
    lanes: list[str] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    monitors: Monitors = field(default_factory=Monitors)
    rss_slope: float = 0.0
    fds_start: int = 0
    fds_end: int = 0
    counters: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    garbage_kib: int = 0
    target_restarts: int = 0
    debug_build: bool = False
    big_cancels: bool = False

    def problems(self) -> list[str]:
        t = self.tally
        out = []
        if t.corrupted:
            out.append(f"{t.corrupted} corrupted")
        if t.hangs:
            out.append(f"{len(t.hangs)} hangs")
        if t.unexplained:
            out.append(f"{t.failed_by_fault['none']} failures no fault explains")
        if t.fence_violations:
            out.append(f"{len(t.fence_violations)} transfers succeeded on a deregistered region")
        if self.rss_slope > RSS_SLOPE_LIMIT:
            out.append(f"RSS grows {self.rss_slope:.1f} MiB/min over the second half (limit {RSS_SLOPE_LIMIT:g})")
        if self.fds_end > self.fds_start + FD_MARGIN:
            out.append(f"descriptors {self.fds_start} -> {self.fds_end}")
        if self.monitors.loop_errors:
            out.append(f"{len(self.monitors.loop_errors)} errors reached the loop's exception handler")
        out += self.leaks + self.tool_errors
        return out

# --------------------------------------------------------------------- report
def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(res: SoakResult) -> str:
    t, mon = res.tally, res.monitors
    rows = [f"soak: {res.seconds:g} s of load (wall {res.wall_s:g} s), seed {res.seed}, keepalive {KEEPALIVE:g} s, "
            f"lanes: {', '.join(res.lanes)}; kvflow.features['debug']: {res.debug_build}",
            "cancelled and timed-out batches: " + ("any shape" if res.big_cancels else
                                                   f"at most {ABORT_MAX_PIECES} pieces (--small-cancels)"), "",
            "| operation | count | ok | cancelled | timed out | failed | hang |",
            "|---|---|---|---|---|---|---|"]
    for op in [o for o, _ in OPERATIONS] + ["connect"]:
        if not t.ops[op]:
            continue
        oc = t.outcomes
        rows.append(f"| {op} | {t.ops[op]} | {oc[f'{op} ok']} | {oc[f'{op} TransferCancelledError']} | "
                    f"{oc[f'{op} TransferTimeoutError']} | {oc[f'{op} failed']} | {oc[f'{op} HANG']} |")
    rows += ["", "| MiB written | MiB read | MiB verified | MiB swept at end "
             "| writes unverifiable (target restarted) |",
             "|---|---|---|---|---|",
             f"| {_mib(t.bytes_written)} | {_mib(t.bytes_read)} | {_mib(t.bytes_verified)} | {_mib(t.bytes_swept)} "
             f"| {t.unverified} |", ""]
    kinds = Counter(f.kind for f in t.faults)
    rows.append("faults injected: " + (", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none")
                + f" (target restarts: {res.target_restarts}; garbage sent: {res.garbage_kib} KiB)")
    rows.append("namespace faults (t s, lasted s): " + (", ".join(
        f"{f.start - t.t0:.0f} {f.kind} {0 if f.end is None else f.end - f.start:.1f}"
        for f in t.faults if f.scope == "ns") or "none"))
    rows.append("failures by error: " + (", ".join(f"{k} {v}" for k, v in t.failed_by_error.most_common())
                                         or "none"))
    rows.append("failures by fault: " + (", ".join(f"{k} {v}" for k, v in t.failed_by_fault.most_common())
                                         or "none"))
    rows.append(f"notifications: {t.notifications_sent} sent, {t.notifications_checked} checked on arrival, "
                f"{t.notifications_unmatched} unmatched")
    rows.append(f"corrupted: {t.corrupted} (late landings of writes abandoned after DRAIN_GRACE: "
                f"{t.late_landings})   hangs: {len(t.hangs)}   unexplained failures: "
                f"{t.failed_by_fault['none']}   fence violations: {len(t.fence_violations)}")
    rss = [s["rss"] for s in mon.samples if s.get("rss") is not None]
    if rss:
        rows.append(f"RSS MiB start/mid/end: {rss[0]:.0f} / {rss[len(rss) // 2]:.0f} / {rss[-1]:.0f}; "
                    f"slope over the second half: {res.rss_slope:+.2f} MiB/min (limit {RSS_SLOPE_LIMIT:g})")
    fds = [s["fds"] for s in mon.samples if s.get("fds") is not None]
    rows.append(f"fds start/peak/end: {res.fds_start} / {max(fds, default=0)} / {res.fds_end} "
                f"(margin {FD_MARGIN})")
    last = [s for s in mon.samples if s.get("target_rss") is not None]
    last = [s for s in last if s["target_gen"] == last[-1]["target_gen"]] if last else []
    if last:
        rows.append(f"namespace target, last of {res.target_restarts + 1} incarnations: RSS MiB peak/last "
                    f"{max(s['target_rss'] for s in last):.0f} / {last[-1]['target_rss']:.0f}, "
                    f"fds peak/last {max(s['target_fds'] for s in last)} / {last[-1]['target_fds']}")
    rows.append(f"loop lag max: {mon.lag_max:.2f} s; stalls over 1 s: {len(mon.stalls)} {mon.stalls[:5]}")
    wk = Counter(warning_kind(m) for _, m in mon.warnings)
    rows.append("kvflow warnings: " + (", ".join(f"{k} x{v}" for k, v in wk.most_common()) or "none"))
    rows += ["", "| engine | load stopped (slices, batches) | after start (sockets, threads) | "
             "peers closed (sockets, threads, slices, batches) | closed |", "|---|---|---|---|---|"]
    c = res.counters
    for n in c.get("after start", {}):
        q, b, p, z = (c.get(k, {}).get(n, {}) for k in ("load stopped", "after start", "peers closed", "closed"))
        rows.append(f"| {n} | {q.get('slices_inflight')}, {q.get('batches')} | {b.get('sockets')}, "
                    f"{b.get('threads')} | {p.get('sockets')}, {p.get('threads')}, {p.get('slices_inflight')}, "
                    f"{p.get('batches')} | {'all 0' if z and not any(z.values()) else z} |")
    if not any(ln.endswith("(rdma)") for ln in res.lanes):
        rows.append("(MR and QP counters: no rdma engine in this soak)")
    else:
        rows.append("| engine (MRs, QPs) | after start and the lanes' registrations | load stopped | peers closed "
                    "| closed |")
        rows.append("|---|---|---|---|---|")
        for n in c.get("after start", {}):
            b, q, p, z = (c.get(k, {}).get(n, {}) for k in ("after start", "load stopped", "peers closed", "closed"))
            rows.append(f"| {n} | {b.get('mrs')}, {b.get('qps')} | {q.get('mrs')}, {q.get('qps')} | "
                        f"{p.get('mrs')}, {p.get('qps')} | {z.get('mrs')}, {z.get('qps')} |")
    for title, items in (("unexplained failures", t.unexplained), ("corruption", t.corruption),
                         ("hangs", t.hangs), ("fence violations", t.fence_violations)):
        for it in items[:10]:
            rows.append(f"- {title}: {it}")
    for _, m in [w for w in mon.warnings if "silent for" in w[1]][:10]:
        rows.append(f"- keepalive: {m}")
    for ts, m in [w for w in mon.warnings if "silent for" in w[1]][:10]:
        rows.append(f"  at t={ts} s")
    problems = res.problems()
    rows.append("")
    rows.append("verdict: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return "\n".join(rows)


def plain(obj: Any) -> Any:
    """JSON-ready copy (dataclasses.asdict would count a Counter's items)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {k: plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def to_json(res: SoakResult) -> dict[str, Any]:
    out = plain(res)
    out["tally"]["faults"] = [{"kind": f.kind, "scope": f.scope, "t": round(f.start - res.tally.t0, 2),
                               "lasted": None if f.end is None else round(f.end - f.start, 2)}
                              for f in res.tally.faults]
    out["problems"] = res.problems()
    out["rss_slope_mib_per_min"] = res.rss_slope
    return out
