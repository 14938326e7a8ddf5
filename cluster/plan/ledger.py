"""The planner's record of itself: every prediction ``tandem plan`` makes and every measurement
``tandem bench`` takes of a known topology go into one JSON-lines file, so that each plan can
say how far its last prediction for the same topology, workload and rate was from what was
then measured.

    <cache>/plan/ledger.jsonl   {"kind": "prediction" | "measurement", "at": unix time,
                                 "topology": "1P+1D", "workload": "...", "rate": 2.0 | null,
                                 "figures": {"goodput_rps", "attainment", "ttft_p90_ms", ...}}
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.paths import cache_dir

COMPARED = ("goodput_rps", "attainment", "ttft_p90_ms", "tpot_p90_ms")


def ledger_path() -> Path:
    return cache_dir() / "plan" / "ledger.jsonl"


def append(kind: str, topology: str, workload: str, rate: float | None, figures: dict,
           path: Path | None = None) -> None:
    path = path or ledger_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"kind": kind, "at": time.time(), "topology": topology, "workload": workload, "rate": rate,
             "figures": {k: figures.get(k) for k in COMPARED}}
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _entries(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _same_rate(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 0.01 * max(abs(a), abs(b))


def last_check(topology: str, workload: str, path: Path | None = None) -> list[tuple[dict, dict]]:
    """For each rate, the latest prediction of this topology and workload that a measurement
    taken after it covers: (prediction, the first such measurement)."""
    entries = [e for e in _entries(path or ledger_path()) if e.get("topology") == topology
               and e.get("workload") == workload]
    checks: dict = {}
    for i, prediction in enumerate(entries):
        if prediction["kind"] != "prediction":
            continue
        measured = next((m for m in entries[i + 1:] if m["kind"] == "measurement"
                         and _same_rate(m["rate"], prediction["rate"])), None)
        if measured is not None:
            checks[round(prediction["rate"] or 0.0, 6)] = (prediction, measured)
    return [checks[rate] for rate in sorted(checks)]


def error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None where it cannot be said."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def describe_checks(checks: list[tuple[dict, dict]]) -> list[str]:
    lines = []
    for prediction, measured in checks:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(prediction["at"]))
        parts = []
        for key, name in (("goodput_rps", "goodput"), ("ttft_p90_ms", "TTFT p90"), ("attainment", "attainment")):
            p, m = prediction["figures"].get(key), measured["figures"].get(key)
            e = error(p, m)
            if p is None or m is None:
                continue
            fmt = {"goodput_rps": lambda v: f"{v:.2f} req/s", "attainment": lambda v: f"{v:.0%}"}.get(
                key, lambda v: f"{v:.0f} ms")
            parts.append(f"{name} {fmt(p)} predicted, {fmt(m)} measured" + (f" ({e:+.0%})" if e is not None else ""))
        rate = f" at {prediction['rate']:g} req/s" if prediction["rate"] else ""
        lines.append(f"last time{rate} ({when}): " + "; ".join(parts))
    return lines
