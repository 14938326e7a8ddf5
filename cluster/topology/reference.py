"""The topology reference (``docs/topology.md``), rendered from the keys' declarations in
``spec.py``; ``python -m cluster.topology.reference > docs/topology.md`` writes it and a unit
test checks that it is up to date."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from cluster.topology.spec import ClusterSpec

# The router's keys are read (and checked) by router.config.RouterConfig.from_mapping; their docs
# are kept here, with the rest of the file's.
ROUTER_KEYS = (
    ("policy", "``slo``", "``slo``, ``prefix_affinity``, ``least_loaded`` or ``round_robin``."),
    ("weights", "the policy's", "Scorer name to weight >= 0, over the policy's preset: ``round_robin``, "
     "``least_loaded``, ``prefix_affinity``, ``slo_headroom``."),
    ("admission_control", "true for ``slo``", "Refuse or queue requests no pair can serve within their objectives."),
    ("slo_classes", "interactive, standard, batch", "Class name to ``{ttft_ms, tpot_ms, priority, on_overload}``: "
     "objectives in milliseconds (null: none), an integer priority, and ``reject``, ``queue`` or ``admit`` when no "
     "pair can meet them. Giving this key replaces the three default classes."),
    ("default_class", "``standard``", "The class of a request that names none; must be one of ``slo_classes``."),
    ("skip_prefill_fraction", "0.9", "A decode worker caching this share of a prompt may prefill it itself, "
     "in (0, 1]."),
    ("local_prefill_max_tokens", "256", "... and so may one with at most this many prompt tokens left to compute "
     "(0: only by the share above). The router then compares the predicted TTFT and TPOT of prefilling there "
     "against a prefill worker's, and picks what meets the objectives with the most headroom (conditional "
     "disaggregation, per request)."),
    ("migration_limit", "3", "Times a request may move after a worker failed under it: a decode worker that died "
     "mid-stream (prompt and the tokens already sent are prefilled elsewhere and the stream resumes), or a prefill "
     "worker that died before its KV landed. An integer >= 0."),
    ("load_refresh_s", "0.05", "How stale the router's view of load may get, > 0."),
    ("registry_retry_s", "1.0", "After a registry failure, seconds of placing by load only before trying again, > 0."),
    ("queue_limit", "4096", "Requests the router may hold until it can place them; past it, a request of a "
     "``queue`` class is rejected (RESOURCE_EXHAUSTED) instead of waiting. An integer >= 1."),
    ("correction_limit_ms", "500", "Bound, either way, of the TTFT correction the router learns from finished "
     "requests (what its step-time models leave out: control-plane hops, contention), >= 0."),
    ("correction_half_life_s", "30", "Seconds after which an unrefreshed correction has halved, > 0."),
    ("prefill_shortlist", "16", "Prefill workers a placement pairs with every decode worker: those predicted to "
     "have the prompt prefilled soonest (queue, then prefill with their cached prefix). Pairs grow as prefill x "
     "decode workers, so a large pool is cut to this many first. An integer >= 1."),
)

INTRO = """\
# Topology reference

One YAML document describes a whole Tandem deployment (`tandem up --topology FILE`). Every key
is optional; a missing key takes the default shown in parentheses. `tandem validate FILE`
checks a file and prints it back with every default filled in; a file with mistakes is refused
as a whole, each mistake as `FILE:LINE: dotted.key: what is wrong`.

This page is generated from the keys' declarations in `cluster/topology/spec.py`
(`python -m cluster.topology.reference > docs/topology.md`).
"""


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"``{value}``"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _paragraph(text: str, indent: int) -> list[str]:
    text = " ".join(text.replace("``", "`").split())
    return textwrap.wrap(text, width=100, initial_indent=" " * indent, subsequent_indent=" " * indent,
                         break_on_hyphens=False, break_long_words=False)


def _keys(cls: type, indent: int) -> list[str]:
    lines = []
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            lines.append(" " * indent + f.name)
            lines += _paragraph(f.metadata["doc"], indent + 4) + [""]
            lines += _keys(f.metadata["section"], indent + 4)
            continue
        if f.metadata.get("shown") is not None:
            default = f.metadata["shown"]
        elif f.default is not dataclasses.MISSING:
            default = _shown(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _shown(f.default_factory())
        else:
            default = "required"
        lines.append(" " * indent + f"{f.name} ({default})")
        lines += _paragraph(f.metadata["doc"], indent + 4)
    return lines + [""]


def render() -> str:
    """The reference, section by section, in the file's own order."""
    lines = [INTRO, "```"]
    lines += ["cluster"] + _keys_of_field(ClusterSpec, "name", 4)
    done = set()
    for f in dataclasses.fields(ClusterSpec):
        if "section" not in f.metadata or f.name in done:
            continue
        alike = [g.name for g in dataclasses.fields(ClusterSpec) if "section" in g.metadata
                 and g.metadata["section"] is f.metadata["section"] and g.metadata["doc"] == f.metadata["doc"]]
        done.update(alike)
        lines.append(", ".join(alike))
        if f.metadata["doc"]:
            lines += _paragraph(f.metadata["doc"], 4) + [""]
        if f.name == "router":
            for name, default, doc in ROUTER_KEYS:
                lines.append(f"    {name} ({default})")
                lines += _paragraph(doc, 8)
            lines.append("")
        else:
            lines += _keys(f.metadata["section"], 4)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines + ["```", ""]).replace("``", "`")


def _keys_of_field(cls: type, name: str, indent: int) -> list[str]:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return [" " * indent + f"{f.name} ({_shown(f.default)})", *_paragraph(f.metadata["doc"], indent + 4), ""]


if __name__ == "__main__":
    print(render(), end="")
