"""The README's section on the request path names each file a request passes, in order, with
the name that does the work there: each file is where the section says, and each name is
defined in the file it follows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[`(?P<text>[^`]+)`\]\((?P<target>[^)]+)\)(?:\s+`(?P<name>[A-Za-z_][\w.]*)`)?")


def section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### The request path")
    return readme[start:readme.index("\n### ", start + 1)]


def steps() -> list[str]:
    """The numbered list's items, each joined into one line."""
    items, current = [], None
    for line in section().splitlines():
        if re.match(r"\d+\. ", line):
            current = [line]
            items.append(current)
        elif current is not None and line.startswith("   "):
            current.append(line.strip())
        else:
            current = None
    return [" ".join(item) for item in items]


def defined(path: Path) -> set[str]:
    """Top-level functions and classes, and Class.method for their methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def test_the_request_path_is_listed_in_order_from_the_api_to_the_answer():
    items = steps()
    assert [int(item.split(".")[0]) for item in items] == list(range(1, len(items) + 1))
    first_file = [LINK.search(item).group("target") for item in items]
    assert first_file[0] == "cluster/ingress/replica.py" and first_file[-1] == "cluster/ingress/request_path.py"
    order = ["cluster/ingress/grpc_server.py", "cluster/ingress/request_path.py", "router/service.py",
             "cluster/protocol/messages.py", "decode_worker/worker.py", "prefill_worker/worker.py",
             "cluster/worker/engine_worker.py"]
    assert [first_file.index(path) for path in order] == sorted(first_file.index(path) for path in order)


def test_each_file_and_name_is_where_the_section_says():
    links = [m for item in steps() for m in LINK.finditer(item)]
    assert len(links) >= 20
    for link in links:
        path = ROOT / link["target"]
        assert link["text"] == link["target"], link.group(0)
        assert path.is_file(), f"{link['target']} (named in the README's request path) does not exist"
        if link["name"]:
            assert link["name"] in defined(path), f"{link['name']} is not defined in {link['target']}"
