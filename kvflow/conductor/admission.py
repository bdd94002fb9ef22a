"""Admission by cost: refuse the dearest prefills while the cluster is loaded.

The conductor's gate (`RejectionMode`) refuses a request when its estimated
TTFT misses the SLO. At the load where that gate starts refusing, the
queues are long everywhere and it refuses whoever arrives next, cheap or
dear. Capacity is measured as the rate at which `target` (90%) of the
requests meet the SLOs, so a cluster may refuse up to a tenth of them; it
serves the most when those are the ones that would cost the most prefill
seconds (`bounds.pool_bound_rps` serves the cheapest `target` share). That
is what Mooncake's early rejection is for ([FAST'25], overload: refuse before the
prefill is spent, on the load predicted), here with the prefill cost as the
measure of what a request takes from the others.

`CostAdmission` keeps the estimated prefill seconds of the last `window`
requests (what they would take where the policy put them, with the prefix
cached there, moved or fetched from the pool counted) and, while the mean
wait of the prefill instances is at least `load` of the TTFT SLO, refuses a
request whose own cost is above the `1 - budget` quantile of that window.
Below that load it refuses nothing (a refusal is a request lost; the gate
alone keeps the SLO). The rule sees only what the conductor estimates for
every policy, so any policy can be given it; with `kvcache` the cost is the
cheapest option's, so a request that a cached prefix or the pool makes
cheap is kept.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

__all__ = ["AdmissionSpec", "CostAdmission", "parse_admission"]


@dataclass
class CostAdmissionStats:
    seen: int = 0
    refused: int = 0


class CostAdmission:
    """See the module's docstring. `budget`: the share of the dearest
    requests it may refuse under load; `load`: the mean prefill wait, as a
    share of the TTFT SLO, from which it refuses; `window`: how many recent
    costs the quantile is taken over; `warmup`: costs seen before it refuses
    anything (a quantile of a few is noise)."""

    def __init__(self, *, budget: float = 0.08, load: float = 0.5, window: int = 1024,
                 warmup: int = 64) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if not load >= 0:
            raise ValueError(f"load must be >= 0, got {load}")
        if window < 1 or warmup < 0:
            raise ValueError("window must be >= 1 and warmup >= 0")
        self.budget = budget
        self.load = load
        self.window = window
        self.warmup = warmup
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self.stats = CostAdmissionStats()

    def threshold(self) -> float:
        """The cost above which a request is refused under load (inf until
        `warmup` costs are seen)."""
        n = len(self._sorted)
        if n < max(1, self.warmup):
            return float("inf")
        return self._sorted[min(n - 1, int((1 - self.budget) * n))]

    def refuse(self, cost_s: float, wait_s: float, slo_ttft_s: float) -> str | None:
        """Record a request's estimated prefill `cost_s` and answer why it is
        refused (None: admitted), given the prefill instances' mean wait
        `wait_s`."""
        limit = self.threshold()
        self._record(cost_s)
        self.stats.seen += 1
        if wait_s < self.load * slo_ttft_s or cost_s <= limit:
            return None
        self.stats.refused += 1
        return (f"prefill {cost_s:.2f} s above the dearest {self.budget:.0%} ({limit:.2f} s)"
                f" with the instances {wait_s:.1f} s behind")

    def _record(self, cost_s: float) -> None:
        self._recent.append(cost_s)
        bisect.insort(self._sorted, cost_s)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]


@dataclass(frozen=True)
class AdmissionSpec:
    """How to make a fresh `CostAdmission` for each replay (it keeps state),
    and which policies get it: `only` None for every policy."""

    budget: float = 0.08
    load: float = 0.5
    only: tuple[str, ...] | None = None

    def make(self, policy: str) -> CostAdmission | None:
        if self.only is not None and policy not in self.only:
            return None
        return CostAdmission(budget=self.budget, load=self.load)

    def describe(self) -> str:
        who = "every policy" if self.only is None else ", ".join(self.only)
        return f"cost (budget {self.budget:g}, load {self.load:g}) for {who}"


def parse_admission(s: str) -> AdmissionSpec:
    """`--admission cost[:BUDGET,LOAD][@POLICY,...]`: the cost rule with
    its budget and load (defaults 0.08 and 0.5), for the policies named
    (default every policy). ValueError on anything else."""
    who = None
    if "@" in s:
        s, names = s.split("@", 1)
        who = tuple(x for x in names.split(",") if x)
        if not who:
            raise ValueError("--admission: no policy after @")
    kind, _, params = s.partition(":")
    if kind != "cost":
        raise ValueError(f"--admission: unknown rule {kind!r} (known: cost)")
    budget, load = 0.08, 0.5
    if params:
        try:
            budget, load = (float(x) for x in params.split(","))
        except ValueError:
            raise ValueError(f"--admission wants cost:BUDGET,LOAD, got {s!r}") from None
    CostAdmission(budget=budget, load=load)      # the same checks, raised now
    return AdmissionSpec(budget, load, who)
