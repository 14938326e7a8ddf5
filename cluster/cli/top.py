"""``tandem top``: a live view of a running cluster, redrawn every ``--interval`` seconds.

    tandem top [--cluster NAME | --addr HOST:PORT] [--interval 1] [--iterations N]

Each frame reads the cluster's status through its API (``GetStatus``: no Ray client, so no
Ray job per frame) and shows the workers (role, TP, state, KV use, waiting, running,
receiving, hit rate), the routers (placements and rejections, with their rates since the
last frame, queue, requests in flight, the last rejection) and goodput and SLO attainment per
class over the last minute. On a terminal each frame replaces the last; otherwise (a pipe, a
file) frames follow each other, separated by a blank line. Ctrl-C ends it.
"""

from __future__ import annotations

import sys
import time

from cluster.cli.status import (
    ApiTarget, fetch_status, goodput_lines, health_line, speculation_lines, table, worker_rows,
)

CLEAR = "\x1b[H\x1b[2J"


def _bar(used: int, total: int, width: int = 10) -> str:
    filled = min(width, max(1 if used else 0, round(width * used / total))) if total else 0
    return "#" * filled + "." * (width - filled)


def render(status: dict, previous: dict | None, elapsed_s: float | None, now: float) -> str:
    """One frame of ``tandem top`` as text."""
    router = status["router"]
    lines = [f"tandem top - {time.strftime('%H:%M:%S', time.localtime(now))}  cluster {status['cluster']}  model "
             f"{status['model']}  API {status['api']}  {health_line(status)}", ""]
    rows = worker_rows(status)
    rows[0] = (*rows[0], "KV")
    for i, w in enumerate(status["workers"], start=1):
        rows[i] = (*rows[i], _bar(w["kv_blocks_used"], w["kv_blocks"]) if w.get("state") == "alive" else "")
    lines += table(rows)
    lines += speculation_lines(status)

    def rate(key: str) -> str:
        if previous is None or not elapsed_s:
            return ""
        return f" ({(router[key] - previous['router'][key]) / elapsed_s:.1f}/s)"

    lines += ["", f"routers: {status['routers']}, policy {router['policy']}, registry {router['registry']}",
              f"  placed {router['placed']}{rate('placed')}, prefilled on decode {router['local_prefills']}, "
              f"rejected {router['rejected']}{rate('rejected')}, waiting {router['waiting']}, in flight "
              f"{router['in_flight']}"]
    if router.get("last_rejection"):
        lines.append(f"  last rejection: {router['last_rejection'][:160]}")
    if router.get("failed_workers"):
        lines.append(f"  failed workers: {', '.join(router['failed_workers'])}")
    lines.append("")
    goodput = status.get("goodput")
    lines += goodput_lines("goodput, last minute", goodput["last_minute"]) if goodput else [
        "goodput: registry unreachable"]
    return "\n".join(lines)


def run_top(target: ApiTarget, interval_s: float = 1.0, iterations: int | None = None, out=None) -> int:
    """Draws frames until interrupted (or ``iterations`` of them); returns the exit status."""
    out = out or sys.stdout
    live = out.isatty()
    previous, previous_at, drawn = None, None, 0
    try:
        while iterations is None or drawn < iterations:
            started = time.monotonic()
            try:
                status = fetch_status(target, timeout_s=max(5.0, 3 * interval_s))
            except LookupError as exc:
                print(f"tandem top: {exc}", file=sys.stderr)
                return 1
            elapsed = started - previous_at if previous_at is not None else None
            frame = render(status, previous, elapsed, time.time())
            out.write(CLEAR + frame + "\n" if live else ("\n" if drawn else "") + frame + "\n")
            out.flush()
            previous, previous_at, drawn = status, started, drawn + 1
            if iterations is None or drawn < iterations:
                time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        if live:
            out.write("\n")
    return 0
