"""Process-group names and ports are pure functions of (cluster, group)."""

from __future__ import annotations

import pytest

from cluster.parallel.naming import PORT_RANGE, GroupNameError, group_id, group_port

pytestmark = pytest.mark.unit


def test_port_is_stable_and_in_range():
    port = group_port("prod", "decode-0-tp")
    assert port == group_port("prod", "decode-0-tp")
    assert PORT_RANGE[0] <= port < PORT_RANGE[1]
    assert port < 32768, "outside Linux's ephemeral port range"


def test_two_clusters_get_different_ports_and_prefixes():
    assert group_port("staging", "engine-tp") != group_port("prod", "engine-tp")
    assert group_id("staging", "engine-tp") == "staging/engine-tp"
    ports = {group_port(f"cluster-{i}", "engine-tp") for i in range(200)}
    assert len(ports) > 195


@pytest.mark.parametrize("bad", ["", "has space", "slash/inside", "-leading", "x" * 64])
def test_bad_names_are_refused_with_the_rule(bad):
    with pytest.raises(GroupNameError, match="letters, digits"):
        group_id(bad, "engine-tp")
