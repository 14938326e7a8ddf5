"""docs/topology.md is the reference rendered from the keys' declarations: it is up to date,
and every key the reader checks is documented in it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cluster.topology.reference import render
from cluster.topology.spec import ClusterSpec, checked_keys
from router.config import RouterConfig

pytestmark = pytest.mark.unit

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "topology.md"


def test_the_reference_is_up_to_date():
    assert REFERENCE.read_text(encoding="utf-8") == render(), \
        "run: python -m cluster.topology.reference > docs/topology.md"


def test_every_checked_key_has_a_doc():
    seen = []

    def walk(cls: type) -> None:
        for f in dataclasses.fields(cls):
            if "section" in f.metadata and dataclasses.is_dataclass(f.metadata["section"]) \
                    and f.name != "router":
                walk(f.metadata["section"])
            elif f.name in checked_keys(cls):
                assert f.metadata["doc"].strip(), f"{cls.__name__}.{f.name} has no doc"
                seen.append(f.name)

    walk(ClusterSpec)
    assert "transfer_timeout_s" in seen and "sample_ratio" in seen


def test_every_router_key_has_a_doc_and_a_reader():
    for f in dataclasses.fields(RouterConfig):
        assert f.metadata["doc"].strip() and f.metadata["read"], f"RouterConfig.{f.name} has no doc or reader"


def test_the_router_section_as_written_reads_back():
    config = RouterConfig.for_policy("prefix_affinity", correction_limit_ms=123.456, queue_limit=7,
                                     slo_classes={"chat": {"ttft_ms": 250, "on_overload": "reject"}},
                                     default_class="chat")
    for written in (RouterConfig(), config):
        assert RouterConfig.from_mapping(written.to_mapping()) == written
