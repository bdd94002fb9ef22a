"""PNG plots of replays: goodput against load per policy, and TTFT CDFs.
Needs matplotlib (the `plot` extra); imported only by `replay --plot`."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from .sim import SimResult

__all__ = ["plot_runs"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvflow[plot]'") from None
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    return plt


def plot_runs(rows: Sequence[Mapping[str, object]], results: Mapping[tuple[str, float], SimResult],
              out_dir: str, *, slo_ttft_s: float, slo_tbt_s: float) -> list[str]:
    """Write goodput_vs_load.png and ttft_cdf.png into `out_dir` (made if
    missing); returns their paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    speedups = sorted({float(r["speedup"]) for r in rows})   # type: ignore[arg-type]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol in policies:
        pts = sorted((float(r["rate_rps"]), float(r["goodput_rps"])) for r in rows if r["policy"] == pol)  # type: ignore[arg-type]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel(f"goodput (requests/s within TTFT {slo_ttft_s:g} s, TBT {slo_tbt_s * 1e3:g} ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "goodput_vs_load.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    n = len(speedups)
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.8 * math.ceil(n / cols)),
                             squeeze=False)
    for i, sp in enumerate(speedups):
        ax = axes[i // cols][i % cols]
        for pol in policies:
            res = results.get((pol, sp))
            if res is None:
                continue
            ttft = sorted(o.ttft_s for o in res.outcomes if o.completed)
            if not ttft:
                continue
            ys = [(k + 1) / len(res.outcomes) for k in range(len(ttft))]
            ax.plot(ttft, ys, label=pol)
        ax.axvline(slo_ttft_s, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"replay x{sp:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for j in range(n, len(axes) * cols):
        axes[j // cols][j % cols].axis("off")
    fig.tight_layout()
    path = os.path.join(out_dir, "ttft_cdf.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths
