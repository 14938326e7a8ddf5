"""A cluster that cannot start says so in one line: which worker, what went wrong, and the
setting to change. The caller then stops whatever did start (placement groups, actors, the
private Redis), so nothing is left running.

Three kinds of failure end a start:

* a worker's constructor raises (a bad model, a KV budget that leaves no room): Ray would
  print that creation task's traceback on the driver's terminal, so the actors Tandem starts
  are :func:`guarded`: a constructor's exception is kept and raised by ``started()``, where
  the driver turns it into its one line;
* a worker is killed while it starts, by Ray's memory monitor or the kernel's OOM killer:
  the line names the KV memory setting (``--kv-cache-memory-fraction`` of ``tandem run``,
  ``kv.cache_memory_fraction`` of a topology);
* a worker's ranks cannot be placed: the line names what the placement asked for and the
  settings that decide it.

How settings are spelled depends on where they came from: :data:`CLI_SETTINGS` (``tandem
run``) or :data:`TOPOLOGY_SETTINGS` (``tandem up``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.engine.request_limits import clip

_ALLOCATION_FAILED = re.compile(r"out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE)
_TRIED_BYTES = re.compile(r"tried to allocate (\d+) bytes")
_RAY_MEMORY_KILL = re.compile(r"low on memory|memory pressure", re.IGNORECASE)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OUR_MODULES = ("cluster.", "router.", "prefill_worker.", "decode_worker.")


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message is one line naming the worker and what to change."""


@dataclass(frozen=True)
class SettingNames:
    """How a user spells the settings a start-up failure points at."""

    kv_memory: str
    kv_blocks: str
    prefill_placement: str
    decode_placement: str
    batch: str

    def placement(self, role: str) -> str:
        return self.prefill_placement if role == "prefill" else self.decode_placement


CLI_SETTINGS = SettingNames("--kv-cache-memory-fraction", "--num-kv-blocks", "--prefill-tp or --prefill-workers",
                            "--decode-tp or --decode-workers", "--max-num-seqs")
TOPOLOGY_SETTINGS = SettingNames("kv.cache_memory_fraction", "kv.num_blocks",
                                 "prefill.tp, prefill.cpus_per_rank, prefill.gpus_per_rank or prefill.node.resources",
                                 "decode.tp, decode.cpus_per_rank, decode.gpus_per_rank or decode.node.resources",
                                 "max_num_seqs of the pools")


def guarded(cls: type) -> type:
    """``cls`` for a Ray actor whose constructor never raises: a failure is kept, and the
    first call of ``started()`` raises it (as a method's error, which Ray does not print)."""

    class Guarded(cls):
        def __init__(self, *args, **kwargs):
            self._start_error: BaseException | None = None
            try:
                super().__init__(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - kept for started(), which raises it
                self._start_error = exc

        def started(self) -> bool:
            if self._start_error is not None:
                raise self._start_error
            return True

    Guarded.__name__ = cls.__name__
    Guarded.__qualname__ = cls.__qualname__
    Guarded.__doc__ = cls.__doc__
    return Guarded


def exception_line(exc: BaseException) -> str:
    """One line of what an exception (a Ray error included) says, user input clipped."""
    return _failure(exc)[1]


def _failure(exc: BaseException) -> tuple[str, str]:
    """(kind, one line): kind is ``memory`` (killed for memory, or an allocation failed),
    ``died`` (the process ended otherwise) or ``raised``."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None:
        return _failure(exc.cause)
    if isinstance(exc, ray.exceptions.OutOfMemoryError):
        return "memory", "Ray's memory monitor killed it: the node ran low on memory"
    if isinstance(exc, ray.exceptions.RayActorError):
        text = _ANSI.sub("", getattr(exc, "error_msg", "") or str(exc))
        if exc.actor_init_failed:
            line = last_exception_line(text)
        elif _RAY_MEMORY_KILL.search(text):
            return "memory", "Ray's memory monitor killed it: the node ran low on memory"
        else:
            return "died", "its process died (a signal, the kernel's out-of-memory killer, or a crash)"
    else:
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        ours = (type(exc).__module__ or "").startswith(_OUR_MODULES) or isinstance(exc, (ValueError, OSError))
        line = clip(first if first and ours else f"{type(exc).__name__}: {first}".rstrip(": "), 300)
        if isinstance(exc, MemoryError):
            return "memory", line
    memory = _ALLOCATION_FAILED.search(line) or _RAY_MEMORY_KILL.search(line)  # also a rank's, reported by rank 0
    tried = _TRIED_BYTES.search(line)
    if memory and tried:  # torch's CPU allocator names the size among much else
        line = f"could not allocate {int(tried.group(1)) / 2**30:,.1f} GiB"
    return ("memory" if memory else "raised"), line


def last_exception_line(text: str) -> str:
    """The last line of a traceback's text, its exception's message (user input clipped)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "it failed while starting"
    match = _EXCEPTION_LINE.match(lines[-1])
    if match is None:
        return clip(lines[-1], 300)
    name, message = match.groups()
    return clip(message if name.endswith("StartError") else f"{name}: {message}", 300)


def worker_failed(name: str, exc: BaseException, settings: SettingNames, memory_fraction: float | None,
                  num_blocks: int | None) -> ClusterStartError:
    """The one-line error for a worker (``prefill-0``) that failed to start: out of memory
    (naming the KV memory setting), died, or raised."""
    kind, line = _failure(exc)
    if kind == "memory":
        if num_blocks is not None:
            change = f"lower {settings.kv_blocks} (now {num_blocks})"
        else:
            change = f"lower {settings.kv_memory} (now {memory_fraction:g}) or give {settings.kv_blocks}"
        return ClusterStartError(f"{name} ran out of memory while starting ({line}): {change}")
    if kind == "died":
        return ClusterStartError(f"{name} died while starting: {line}; if it ran out of memory, lower "
                                 f"{settings.kv_memory}")
    return ClusterStartError(f"{name} failed to start: {line}")


def serving_failed(exc: BaseException, settings: SettingNames) -> str:
    """One line for a Ray error that ends a run after the start (a worker killed mid-run)."""
    kind, line = _failure(exc)
    hint = f"; lower {settings.kv_memory} or {settings.batch}" if kind in ("memory", "died") else ""
    return f"a worker failed while serving: {line}{hint}"


def placement_failed(name: str, role: str, tp: int, bundle: dict[str, float], settings: SettingNames,
                     never: bool) -> ClusterStartError:
    """The one-line error for a worker whose ranks cannot be placed (``never``: no node of the
    cluster could hold them, as opposed to none having room now)."""
    asks = bundle_text(bundle)
    why = "no node of the Ray cluster has" if never else "the Ray cluster has no room for"
    needs = f"its {tp} ranks need {asks} each, all on one node" if tp > 1 else f"its rank needs {asks}"
    return ClusterStartError(f"cannot place {name}: {needs}, and {why} that (see `ray status`); change "
                             f"{settings.placement(role)}")


def bundle_text(bundle: dict[str, float]) -> str:
    """What one rank asks of its node, as ``1 CPU, 1 tandem-prefill``."""
    return ", ".join(f"{amount:g} {resource}" for resource, amount in sorted(bundle.items()))


def node_wanted(tp: int, bundle: dict[str, float]) -> str:
    """The node a worker waits for: its ranks' resources, all on one node."""
    return bundle_text(bundle) if tp == 1 else f"{tp} x ({bundle_text(bundle)})"


def no_node_joined(name: str, tp: int, bundle: dict[str, float], wait_s: float) -> ClusterStartError:
    """The one-line error for a worker added to a running cluster that no node took in time."""
    return ClusterStartError(f"cannot place {name}: no node with {node_wanted(tp, bundle)} joined or freed up "
                             f"within {wait_s:g}s (ray.node_wait_s); its placement group was removed")
