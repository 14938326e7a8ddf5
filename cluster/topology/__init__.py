"""Topology files: one YAML document describes a whole Tandem deployment.

The file becomes a frozen :class:`ClusterSpec`. Every key is optional; a missing key takes its
default. ``tandem validate FILE`` checks a file and prints it back with every default filled
in. A file with mistakes is refused as a whole with :class:`TopologyError`, which lists every
mistake found, each as ``FILE:LINE: dotted.key: what is wrong``.

Each key is declared once, in ``spec.py`` (default, check, doc); ``load.py`` reads a file
through those declarations and ``reference.py`` renders them as ``docs/topology.md``.
"""

from cluster.topology.load import (
    TopologyError,
    TopologyIssue,
    default_topology,
    load_topology,
    parse_topology,
    spec_before_model_check,
    validate_file,
)
from cluster.topology.spec import (
    DEFAULT_MODEL_NAME,
    DTYPES,
    ROLES,
    ClusterSpec,
    KVSpec,
    ModelSpec,
    NodeConstraints,
    ObservabilitySpec,
    PoolSpec,
    RaySpec,
    RegistrySpec,
    ServerSpec,
    SpeculativeSpec,
    TLSSpec,
    TracingSpec,
)

__all__ = [
    "DEFAULT_MODEL_NAME", "DTYPES", "ROLES", "ClusterSpec", "KVSpec", "ModelSpec", "NodeConstraints",
    "ObservabilitySpec", "PoolSpec", "RaySpec", "RegistrySpec", "ServerSpec", "SpeculativeSpec", "TLSSpec", "TopologyError",
    "TopologyIssue", "TracingSpec", "default_topology", "load_topology", "parse_topology", "spec_before_model_check",
    "validate_file",
]
