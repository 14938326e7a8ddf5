"""The topology reference (``docs/topology.md``), rendered from the keys' declarations in
``spec.py`` (the router's on ``router.config.RouterConfig``'s fields);
``python -m cluster.topology.reference > docs/topology.md`` writes it and a unit test checks that
it is up to date."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from cluster.topology.spec import ClusterSpec
from router.config import RouterConfig, yaml_key

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
            lines += _router_keys(4)
        else:
            lines += _keys(f.metadata["section"], 4)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines + ["```", ""]).replace("``", "`")


def _router_keys(indent: int) -> list[str]:
    """The router's keys, declared on :class:`router.config.RouterConfig`'s fields; a default is
    shown as the file writes it."""
    written = RouterConfig().to_mapping()
    lines = []
    for f in dataclasses.fields(RouterConfig):
        default = f.metadata["shown"] or _shown(written[yaml_key(f)])
        lines.append(" " * indent + f"{yaml_key(f)} ({default})")
        lines += _paragraph(f.metadata["doc"], indent + 4)
    return lines + [""]


def _keys_of_field(cls: type, name: str, indent: int) -> list[str]:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return [" " * indent + f"{f.name} ({_shown(f.default)})", *_paragraph(f.metadata["doc"], indent + 4), ""]


if __name__ == "__main__":
    print(render(), end="")
