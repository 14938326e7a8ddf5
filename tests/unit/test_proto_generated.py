"""The committed generated code (``tandem/v1``) is what ``scripts/gen_proto.sh`` makes from
``proto/``, byte for byte, and it describes ``Generate`` as a server-streaming call."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def _generated_versions() -> tuple[str, str]:
    """(grpcio-tools version, protobuf gencode version) recorded in the committed code."""
    grpc_code = (ROOT / "tandem" / "v1" / "tandem_pb2_grpc.py").read_text()
    pb2_code = (ROOT / "tandem" / "v1" / "tandem_pb2.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_code).group(1)
    protobuf_version = re.search(r"# Protobuf Python Version: (\S+)", pb2_code).group(1)
    return grpc_version, protobuf_version


def test_gen_proto_reproduces_the_committed_code(tmp_path):
    pytest.importorskip("grpc_tools", reason="needs grpcio-tools (the test extra)")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    tools = importlib.metadata.version("grpcio-tools")
    committed_tools, _ = _generated_versions()
    hint = (f"tandem/v1 differs from what scripts/gen_proto.sh makes now (committed code from grpcio-tools "
            f"{committed_tools}, installed {tools}): run `bash scripts/gen_proto.sh` and commit the result")
    for name in GENERATED:
        fresh = (tmp_path / "tandem" / "v1" / name).read_bytes()
        committed = (ROOT / "tandem" / "v1" / name).read_bytes()
        assert fresh == committed, f"{name}: {hint}"
    # Nothing else is written: no stray files next to the three modules.
    assert sorted(p.name for p in (tmp_path / "tandem" / "v1").iterdir()) == sorted(GENERATED)


def test_generated_code_loads_with_the_installed_runtimes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # protobuf warns (or raises) on a gencode/runtime mismatch
        from tandem.v1 import tandem_pb2, tandem_pb2_grpc  # noqa: F401
    import google.protobuf
    import grpc

    grpc_version, protobuf_version = _generated_versions()
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert as_tuple(grpc.__version__) >= as_tuple(grpc_version)
    assert as_tuple(google.protobuf.__version__) >= as_tuple(protobuf_version)


def test_declared_dependencies_admit_only_runtimes_the_generated_code_accepts():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9.]+)", requirement)
        if match:
            floors[match.group(1).lower()] = match.group(2)
    grpc_version, protobuf_version = _generated_versions()
    as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:3])  # noqa: E731
    assert as_tuple(floors["grpcio"]) >= as_tuple(grpc_version), "raise the grpcio floor in pyproject.toml"
    assert as_tuple(floors["protobuf"]) >= as_tuple(protobuf_version), "raise the protobuf floor in pyproject.toml"
    tools = [r for r in project["optional-dependencies"]["test"] if r.startswith("grpcio-tools")]
    assert tools == [f"grpcio-tools=={grpc_version}"], "pin grpcio-tools to the version that made tandem/v1"


def test_generate_is_unary_request_server_streaming():
    from tandem.v1 import tandem_pb2, tandem_pb2_grpc

    service = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    assert service.full_name == "tandem.v1.Tandem"
    assert sorted(service.methods_by_name) == ["Detokenize", "Generate", "GetModelInfo", "GetStatus", "Tokenize"]
    generate = service.methods_by_name["Generate"]
    assert (generate.client_streaming, generate.server_streaming) == (False, True)
    assert generate.input_type.full_name == "tandem.v1.GenerateRequest"
    assert generate.output_type.full_name == "tandem.v1.GenerateResponse"
    for name in ("GetModelInfo", "Tokenize", "Detokenize", "GetStatus"):
        method = service.methods_by_name[name]
        assert (method.client_streaming, method.server_streaming) == (False, False), name

    # The stub asks the channel for a unary-stream callable for Generate, unary-unary for the rest.
    class RecordingChannel:
        def __init__(self):
            self.kinds = {}

        def _record(kind):
            def method(self, path, **kwargs):
                self.kinds[path] = kind
                return object()
            return method

        unary_unary = _record("unary_unary")
        unary_stream = _record("unary_stream")
        stream_unary = _record("stream_unary")
        stream_stream = _record("stream_stream")

    channel = RecordingChannel()
    tandem_pb2_grpc.TandemStub(channel)
    assert channel.kinds == {
        "/tandem.v1.Tandem/Generate": "unary_stream",
        "/tandem.v1.Tandem/GetModelInfo": "unary_unary",
        "/tandem.v1.Tandem/Tokenize": "unary_unary",
        "/tandem.v1.Tandem/Detokenize": "unary_unary",
        "/tandem.v1.Tandem/GetStatus": "unary_unary",
    }
