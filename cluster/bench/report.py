"""How a run is shown: a plain-text table, a JSON file, and PNGs (latency CDFs; goodput and
attainment against request rate for a sweep, measured and predicted on the same axes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from cluster.bench.metrics import ATTAINMENT_GOAL, RequestResult


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(summary: dict, title: str) -> str:
    """The figures of one run as a table."""
    lines = [title, "-" * len(title)]
    g = summary["goodput"]
    lines.append(f"requests: {summary['requests']} sent, {summary['completed']} completed, "
                 f"{summary.get('rejected', 0)} rejected (429 / RESOURCE_EXHAUSTED), {summary['failed']} failed"
                 + (f" ({', '.join(f'{n} {k}' for k, n in summary['errors'].items())})" if summary["errors"] else "")
                 + f"; {summary.get('retried', 0)} retried on a new connection (a kept-alive one was closed)")
    if summary.get("rejected"):
        to_reject, retry = summary["time_to_reject"], summary["retry_after"]
        lines.append(f"rejections: answered in {_ms(to_reject['p50_ms'])} ms p50, {_ms(to_reject['p90_ms'])} ms p90; "
                     f"Retry-After {_ms(retry['p50_ms'])} ms p50, {_ms(retry['p90_ms'])} ms p90 "
                     f"({retry['count']} said one)")
    lines.append(f"duration: {summary['duration_s']:.1f} s; throughput {summary['request_throughput_rps']:.2f} req/s, "
                 f"{summary['input_token_throughput']:.0f} input tok/s, {summary['output_token_throughput']:.0f} "
                 f"output tok/s")
    hit = summary["prefix_cache_hit_rate"]
    lines.append(f"prefix-cache hit rate: {'-' if hit is None else f'{hit:.1%}'} (from usage)")
    header = ("latency (ms)", "mean", "p50", "p90", "p99", "n")
    rows = [header] + [(name, *(_ms(d[k]) for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")), str(d["count"]))
                       for name, d in (("TTFT", summary["ttft"]), ("TPOT", summary["tpot"]), ("ITL", summary["itl"]),
                                       ("end to end", summary["e2e"]))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    objectives = summary["objectives"]
    described = objectives if isinstance(objectives, str) else "; ".join(f"{k}: {v}" for k, v in objectives.items())
    lines.append(f"objectives: {described}")
    lines.append(f"goodput: {g['goodput_rps']:.2f} req/s met both objectives; SLO attainment {g['attainment']:.1%} "
                 f"({g['met']}/{g['requests']}; TTFT met {g['ttft_met']}, TPOT met {g['tpot_met']})")
    for name, c in summary.get("classes", {}).items():
        lines.append(f"  class {name}: goodput {c['goodput_rps']:.2f} req/s, attainment {c['attainment']:.1%} "
                     f"({c['met']}/{c['requests']}, {c.get('rejected', 0)} rejected, {c['failed']} failed)")
    return "\n".join(lines)


def format_sweep(points: Sequence[tuple[float, dict]], goodput_rate: float | None, title: str = "sweep") -> str:
    header = ("rate req/s", "goodput req/s", "attainment", "TTFT p90 ms", "TPOT p90 ms", "throughput req/s", "rejected",
              "failed")
    rows = [header]
    for rate, s in points:
        rows.append((f"{rate:g}", f"{s['goodput']['goodput_rps']:.2f}", f"{s['goodput']['attainment']:.1%}",
                     _ms(s["ttft"]["p90_ms"]), _ms(s["tpot"]["p90_ms"]), f"{s['request_throughput_rps']:.2f}",
                     str(s.get("rejected", 0)), str(s["failed"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [title, "-" * len(title)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append(f"highest rate with attainment >= {ATTAINMENT_GOAL:.0%} (DistServe's goodput): "
                 + (f"{goodput_rate:g} req/s" if goodput_rate is not None else "none of the rates"))
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'tandem[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdfs(path: str | Path, runs: Mapping[str, Sequence[RequestResult]]) -> Path:
    """TTFT, TPOT and end-to-end latency CDFs of one or more runs, side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, get) in zip(axes, (("TTFT", lambda r: r.ttft_s), ("TPOT", lambda r: r.tpot_s),
                                      ("end to end", lambda r: r.e2e_s))):
        for label, results in runs.items():
            values = sorted(v * 1000 for r in results if r.ok and (v := get(r)) is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def plot_sweep(path: str | Path, measured: Mapping[str, Sequence[tuple[float, float, float]]],
               predicted: Mapping[str, Sequence[tuple[float, float, float]]] | None = None,
               title: str = "goodput against request rate") -> Path:
    """Goodput (left) and SLO attainment (right) against offered rate: each series is
    (rate, goodput, attainment) points; predicted series are dashed, in their measured twin's colour."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {}
    for i, (label, points) in enumerate(measured.items()):
        colours[label] = f"C{i}"
        rates = [p[0] for p in points]
        left.plot(rates, [p[1] for p in points], "o-", color=colours[label], label=f"{label} (measured)")
        right.plot(rates, [p[2] * 100 for p in points], "o-", color=colours[label], label=f"{label} (measured)")
    for i, (label, points) in enumerate((predicted or {}).items()):
        colour = colours.get(label, f"C{len(colours) + i}")
        rates = [p[0] for p in points]
        left.plot(rates, [p[1] for p in points], "s--", color=colour, alpha=0.8, label=f"{label} (predicted)")
        right.plot(rates, [p[2] * 100 for p in points], "s--", color=colour, alpha=0.8, label=f"{label} (predicted)")
    top = max([p[0] for series in (*measured.values(), *(predicted or {}).values()) for p in series] or [1.0])
    left.plot([0, top], [0, top], ":", color="grey", linewidth=1, label="goodput = rate")
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("goodput (req/s meeting both objectives)")
    right.axhline(ATTAINMENT_GOAL * 100, color="grey", linestyle=":", linewidth=1)
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("SLO attainment (%)")
    right.set_ylim(0, 102)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)
