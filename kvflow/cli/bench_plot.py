"""kvflow-bench --plot: throughput and latency of a sweep against block
size, one line per batch size. matplotlib is optional (the `plot` extra)
and imported only when a plot is asked for."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvflow.cli.bench_layout import BenchError, format_size

__all__ = ["check_plotting", "plot_sweep", "pyplot"]


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; BenchError naming the
    extra to install when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'kvflow[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_plotting() -> None:
    pyplot()


def plot_sweep(results: Sequence[Any], path: str, *, title: str = "kvflow-bench",
               series: Callable[[Any], str] | None = None) -> str:
    """Two panels, GB/s and p50/p99 latency (log), against block size (log
    2), a line per batch size (or per `series(row)`, a line's label:
    kvflow-bench store draws one per op and batch); returns `path`."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    label = series or (lambda r: f"batch {r.layout.batch}")
    names = list(dict.fromkeys(label(r) for r in sorted(results, key=lambda r: r.layout.batch)))
    for name in names:
        rows = sorted((r for r in results if label(r) == name), key=lambda r: r.layout.block_size)
        xs = [r.layout.block_size for r in rows]
        top.plot(xs, [r.gbps for r in rows], marker="o", label=name)
        line = bottom.plot(xs, [r.latency_p50_us for r in rows], marker="o", label=f"{name} p50")[0]
        bottom.plot(xs, [r.latency_p99_us for r in rows], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{name} p99")
    sizes = sorted({r.layout.block_size for r in results})
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    bottom.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45, fontsize=8)
    top.set_ylabel("GB/s")
    bottom.set_ylabel("batch latency (us)")
    bottom.set_yscale("log")
    bottom.set_xlabel("block size")
    first = results[0] if results else None
    if first is not None:
        title += f", {first.layout.concurrency} in flight"
    top.set_title(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)
    return path
