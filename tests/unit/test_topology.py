"""Topology YAML: the examples, the defaults, every class of mistake with its exact key and
line, the engine arguments, and ``tandem validate``."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from cluster.cli.validate import add_validate_parser
from cluster.engine.config import EngineConfig
from cluster.topology import (
    ClusterSpec,
    KVSpec,
    ModelSpec,
    NodeConstraints,
    PoolSpec,
    ServerSpec,
    TLSSpec,
    TopologyError,
    TopologyIssue,
    default_topology,
    load_topology,
    parse_topology,
    spec_before_model_check,
    validate_file,
)
from router.config import RouterConfig, SloClass

pytestmark = pytest.mark.unit

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, torch_dtype="bfloat16")


def doc(text: str) -> str:
    """Dedented, with the first line of content as line 1."""
    return textwrap.dedent(text).lstrip("\n")


def errors_of(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(TopologyError) as info:
        parse_topology(doc(text), "t.yaml")
    return [(e.key, e.line, e.message) for e in info.value.errors]


def only_error(text: str) -> tuple[str, int | None, str]:
    errors = errors_of(text)
    assert len(errors) == 1, errors
    return errors[0]


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc(text))
    return path


def model_dir(tmp_path: Path, **config) -> Path:
    directory = tmp_path / "llama-8b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**LLAMA_8B, **config}))
    return directory


def run_validate(path, capsys, *flags: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tandem")
    add_validate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["validate", *flags, str(path)])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


# -- examples and defaults ------------------------------------------------------------------

def test_there_are_three_examples():
    assert [p.name for p in EXAMPLES] == ["gpu-node-8b.yaml", "local-cpu.yaml", "multi-node-70b.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_and_round_trips(path):
    """Checked as on a laptop before deployment: the examples' models are on their nodes."""
    spec, errors, warnings = validate_file(path, model_elsewhere=True)
    assert errors == []
    assert load_topology(path, model_elsewhere=True) == spec
    assert parse_topology(spec.to_yaml(), model_elsewhere=True) == spec
    assert yaml.safe_load(spec.to_yaml()) == spec.to_dict()
    for role in ("prefill", "decode"):
        EngineConfig(model="m", **spec.engine_args(role))


def test_local_cpu_example_is_the_default():
    spec, _, warnings = validate_file(EXAMPLES[1])
    assert spec == default_topology()
    assert warnings == []


def test_gpu_example():
    spec, _, warnings = validate_file(EXAMPLES[0], model_elsewhere=True)
    assert (spec.prefill.replicas, spec.prefill.tp, spec.decode.replicas, spec.decode.tp) == (2, 2, 4, 1)
    assert spec.prefill.gpus_per_rank == spec.decode.gpus_per_rank == 1
    assert spec.model == ModelSpec("/models/llama-3.1-8b-instruct", "llama-3.1-8b-instruct", "bfloat16", 16384)
    assert spec.server.tls == TLSSpec("/etc/tandem/tls/server.crt", "/etc/tandem/tls/server.key")
    assert spec.server.auth_token_env == "TANDEM_API_TOKEN"
    assert spec.observability.dashboard is True
    assert [c.name for c in spec.router.slo_classes] == ["chat", "api", "batch"]
    assert spec.router.slo_class("chat") == SloClass("chat", 0.5, 0.05, 2, "reject")
    assert spec.prefill.ranks * spec.prefill.gpus_per_rank + spec.decode.ranks * spec.decode.gpus_per_rank == 8
    assert any("model.path: /models/llama-3.1-8b-instruct does not exist here" in w for w in warnings)


def test_gpu_example_here_needs_its_model():
    """Its Ray is local (ray.address null): `tandem up` here would load the model from this
    machine, so a path that does not exist here is an error, with its line."""
    spec, errors, _ = validate_file(EXAMPLES[0])
    assert spec is None
    assert [(e.key, e.line) for e in errors] == [("model.path", 11)]
    assert "/models/llama-3.1-8b-instruct does not exist here" in errors[0].message


def test_multi_node_example():
    spec, _, warnings = validate_file(EXAMPLES[2])
    assert (spec.prefill.replicas, spec.prefill.tp, spec.decode.replicas, spec.decode.tp) == (2, 8, 4, 4)
    assert spec.prefill.node == NodeConstraints(8, {"tandem-prefill": 0.01})
    assert spec.registry.url.startswith("rediss://") and spec.registry.password_env == "TANDEM_REDIS_PASSWORD"
    assert spec.ray.address == "ray-head.tandem.svc.cluster.local:6379"
    assert spec.model.name == "llama-3.1-70b-instruct"
    assert any("model.path" in w for w in warnings)


def test_examples_tp_fits_a_real_config(tmp_path):
    """The gpu example's TP degrees divide a Llama 3.1 8B config.json."""
    text = EXAMPLES[0].read_text().replace("/models/llama-3.1-8b-instruct", str(model_dir(tmp_path)))
    spec = parse_topology(text)
    assert spec.prefill.tp == 2


def test_default_topology():
    spec = default_topology()
    assert spec == ClusterSpec() == parse_topology("{}") == parse_topology("# nothing here\n")
    assert spec.name == "tandem"
    assert spec.model == ModelSpec(None, "tandem-default", None, None)
    assert spec.prefill == spec.decode == PoolSpec(1, 1, 0, 0.25, NodeConstraints(None, {}), None, 128, None)
    assert spec.kv == KVSpec()
    assert spec.router == RouterConfig()
    assert spec.server == ServerSpec("127.0.0.1", 50051, None, None, None)
    assert spec.observability.dashboard is False
    assert spec.registry.url is None and spec.ray.address is None
    assert spec.colocated == PoolSpec(0, 1, 0, 0.25, NodeConstraints(None, {}), None, 128, None)
    assert list(spec.to_dict()) == ["cluster", "model", "prefill", "decode", "colocated", "kv", "router", "registry",
                                    "server", "observability", "ray"]
    assert parse_topology(spec.to_yaml()) == spec


def test_to_dict_router_in_input_format():
    spec = parse_topology(doc("""
        router:
          policy: least_loaded
          slo_classes:
            fast: {ttft_ms: 300, tpot_ms: null, priority: 3, on_overload: reject}
          default_class: fast
    """))
    router = spec.to_dict()["router"]
    assert router == {
        "policy": "least_loaded", "weights": {"least_loaded": 1.0}, "admission_control": False,
        "slo_classes": {"fast": {"ttft_ms": 300, "tpot_ms": None, "priority": 3, "on_overload": "reject",
                                 "max_wait_ms": None}},
        "default_class": "fast", "skip_prefill_fraction": 0.9, "load_refresh_s": 0.05, "registry_retry_s": 1.0,
        "queue_limit": 4096, "correction_limit_ms": 500, "correction_half_life_s": 30.0,
        "local_prefill_max_tokens": 256, "migration_limit": 3, "prefill_shortlist": 16, "class_headroom": 0.2,
        "class_headroom_window_s": 30.0,
    }
    assert "tpot_ms: null" in spec.to_yaml()
    assert parse_topology(spec.to_yaml()) == spec


def test_round_trip_of_every_setting():
    text = doc("""
        cluster: {name: prod-1}
        model: {path: /m/x, name: served, dtype: float16, max_model_len: 4096}
        prefill:
          replicas: 3
          tp: 2
          gpus_per_rank: 1
          cpus_per_rank: 1.5
          node: {gpus: 4, resources: {a100: 1}}
          max_num_batched_tokens: 4096
          max_num_seqs: 8
          threads: 4
        kv: {block_size: 32, cache_memory_fraction: 0.5, num_blocks: 1000, prefix_caching: false,
             transfer_timeout_s: 2.5, stream_layers: false}
        router: {policy: round_robin, weights: {least_loaded: 0.5}, skip_prefill_fraction: 0.5,
                 slo_classes: {a: {ttft_ms: 123.4, tpot_ms: 0.7}}, default_class: a}
        registry: {url: "redis://r:6379/2", password_env: REDIS_PW}
        server: {host: "::1", port: 0, tls: {cert_file: c, key_file: k}, auth_token_file: tok}
        observability: {dashboard: true, dashboard_port: 9000, metrics_export_port: 9001}
        ray: {num_cpus: 8}
    """)
    spec = parse_topology(text, model_elsewhere=True)
    assert spec.prefill.node.resources == {"a100": 1.0}
    assert spec.router.slo_class("a").ttft_s == pytest.approx(0.1234)
    assert spec.to_dict()["router"]["slo_classes"]["a"]["ttft_ms"] == 123.4
    assert parse_topology(spec.to_yaml(), model_elsewhere=True) == spec


def test_model_name_defaults_to_the_directory():
    assert parse_topology("model: {path: /models/qwen2-7b/}", model_elsewhere=True).model.name == "qwen2-7b"
    assert parse_topology("model: {path: /models/x, name: mine}", model_elsewhere=True).model.name == "mine"


def test_model_dir(tmp_path):
    directory = model_dir(tmp_path)
    assert parse_topology(f"model: {{path: {directory}}}").model_dir() == directory


def test_yaml_anchors_and_merge_keys():
    spec = parse_topology(doc("""
        prefill: &pool
          tp: 3
          max_num_seqs: 16
        decode:
          <<: *pool
          replicas: 3
    """))
    assert (spec.decode.tp, spec.decode.max_num_seqs, spec.decode.replicas) == (3, 16, 3)


# -- engine arguments -----------------------------------------------------------------------

def test_engine_args():
    spec = parse_topology(doc("""
        cluster: {name: east}
        model: {dtype: bfloat16, max_model_len: 1024, quantization: none, cpu_matmul_dtype: bfloat16}
        prefill: {gpus_per_rank: 1, max_num_batched_tokens: 8192, max_num_seqs: 16, threads: 2}
        kv: {block_size: 32, num_blocks: 500, cache_memory_fraction: 0.5, prefix_caching: false}
    """))
    assert spec.engine_args("prefill") == dict(
        dtype="bfloat16", quantization="none", cpu_matmul_dtype="bfloat16", block_size=32, max_num_batched_tokens=8192, kv_cache_dtype="auto", max_num_seqs=16, max_model_len=1024,
        num_kv_blocks=500, kv_cache_memory_fraction=0.5, enable_prefix_caching=False, num_threads=2,
        device="cuda", cluster_name="east", speculative=None, host_cache=None, prompt_draft_model=None,
    )
    decode = spec.engine_args("decode")
    assert (decode["device"], decode["max_num_seqs"], decode["num_threads"]) == ("cpu", 128, None)
    config = EngineConfig(model="m", engine_name="prefill-0", tensor_parallel_size=spec.prefill.tp,
                          **spec.engine_args("prefill"))
    assert config.cluster_name == "east" and config.block_size == 32
    with pytest.raises(ValueError, match="role"):
        spec.engine_args("router")


def test_host_cache_reaches_the_engines_as_written():
    assert parse_topology("kv:\n  host_cache: 512MiB\n").engine_args("decode")["host_cache"] == "512MiB"
    assert parse_topology("kv:\n  host_cache: 300\n").engine_args("colocated")["host_cache"] == 300
    key, line, message = only_error("kv:\n  host_cache: 512MB\n")
    assert (key, line) == ("kv.host_cache", 2)
    assert message == ("must be null, a positive number of blocks or a size such as '512MiB' or '2GiB'; "
                       "got '512MB'")


def test_peer_pull_is_off_by_default_and_read_with_its_timeout(tmp_path, capsys):
    assert (parse_topology("").kv.peer_pull, parse_topology("").kv.pull_timeout_s) == (False, 5.0)
    spec = parse_topology("decode: {replicas: 2}\nkv:\n  peer_pull: true\n  pull_timeout_s: 1.5\n")
    assert (spec.kv.peer_pull, spec.kv.pull_timeout_s) == (True, 1.5)
    assert "peer_pull" not in spec.engine_args("decode")  # the deployment's pairing, no engine setting
    code, out, _ = run_validate(write(tmp_path, "kv:\n  peer_pull: true\n"), capsys)
    assert code == 0 and yaml.safe_load(out)["kv"]["peer_pull"] is True


@pytest.mark.parametrize("text, line, message", [
    ("prefill: {replicas: 0}\ndecode: {replicas: 0}\ncolocated: {replicas: 2}\nkv:\n  peer_pull: true\n", 5,
     "pulls go between decode workers and the topology has none (decode.replicas is 0); set kv.peer_pull: false, "
     "or declare decode workers"),
    ("kv:\n  prefix_caching: false\n  peer_pull: true\n", 3,
     "pulls send a peer's cached prefix, and kv.prefix_caching is false; set kv.peer_pull: false, or "
     "kv.prefix_caching: true"),
    ("kv:\n  peer_pull: sometimes\n", 2, None),
])
def test_peer_pull_is_refused_where_no_pull_can_happen_in_one_line_naming_it(tmp_path, capsys, text, line, message):
    key, where, said = only_error(text)
    assert (key, where) == ("kv.peer_pull", line)
    if message is not None:
        assert said == message
    code, _, err = run_validate(write(tmp_path, text), capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1 and f"t.yaml:{line}: kv.peer_pull: " in err


def test_speculative_decoding_reaches_the_engines_of_decode_and_colocated_workers_only():
    from cluster.engine.speculative.config import SpeculativeConfig

    spec = parse_topology(doc("""
        decode:
          speculative: {num_tokens: 6, adaptive: false, ngram_min: 1, ngram_max: 3}
        colocated:
          replicas: 1
          speculative: {}
    """))
    assert spec.engine_args("decode")["speculative"] == SpeculativeConfig("ngram", 6, False, 1, 3)
    assert spec.engine_args("colocated")["speculative"] == SpeculativeConfig()
    assert spec.engine_args("prefill")["speculative"] is None
    config = EngineConfig(model="m", **spec.engine_args("decode"))
    assert config.speculative == SpeculativeConfig("ngram", 6, False, 1, 3)
    assert parse_topology(spec.to_yaml()) == spec
    off = default_topology()
    assert off.decode.speculative is None and off.engine_args("decode")["speculative"] is None
    assert parse_topology("decode:\n  speculative: null\nprefill:\n  speculative: null\n") == off


def test_the_pools_engine_settings_carry_speculation_to_decode_workers_only():
    from cluster.deployment.pools import pools_of
    from cluster.engine.speculative.config import SpeculativeConfig

    spec = parse_topology("decode:\n  speculative: {num_tokens: 2}\n")
    settings = {pool.role: dict(pool.engine_args) for pool in pools_of(spec)}
    assert settings["decode"]["speculative"] == SpeculativeConfig(num_tokens=2)
    assert settings["prefill"]["speculative"] is None
    spec = parse_topology("decode:\n  speculative: {}\n")  # num_tokens left out: the method's
    assert {pool.role: dict(pool.engine_args) for pool in pools_of(spec)}["decode"]["speculative"].num_tokens == 8
    from cluster.offline.spec_from_args import disaggregated_spec

    spec, overrides = disaggregated_spec("/models/m", speculative=SpeculativeConfig(num_tokens=3, adaptive=False))
    assert spec.decode.speculative.config() == SpeculativeConfig(num_tokens=3, adaptive=False)
    assert spec.prefill.speculative is None and "speculative" not in overrides.common


def test_the_prefill_workers_load_the_decode_pools_draft_unless_it_builds_prompts_draft_kv_itself():
    """``decode.speculative.draft_prompt_kv``: auto and prefill give the prefill engines the draft
    (``prompt_draft_model``), decode none; the decode engines get the place in their config."""
    from cluster.engine.speculative.config import SpeculativeConfig

    for place, loaded in (("auto", "/models/small"), ("prefill", "/models/small"), ("decode", None)):
        spec = parse_topology(doc(f"""
            decode:
              speculative: {{method: draft, draft_model: /models/small, draft_prompt_kv: {place}}}
        """), model_elsewhere=True)
        assert spec.engine_args("prefill")["prompt_draft_model"] == loaded
        assert spec.engine_args("prefill")["speculative"] is None
        assert spec.engine_args("decode")["prompt_draft_model"] is None
        assert spec.engine_args("decode")["speculative"] == SpeculativeConfig(
            method="draft", draft_model="/models/small", draft_prompt_kv=place)
        EngineConfig(model="m", **spec.engine_args("prefill"))
    assert parse_topology("decode:\n  speculative: {}\n").engine_args("prefill")["prompt_draft_model"] is None


def test_draft_prompt_kv_combinations_that_cannot_work_are_refused_in_one_line():
    assert only_error(doc("""
        colocated:
          replicas: 1
          speculative: {method: draft, draft_model: /m, draft_prompt_kv: prefill}
    """)) == ("colocated.speculative.draft_prompt_kv", 3, "a colocated pool has no prefill worker: its draft builds "
              "its prompts' KV itself; remove prefill (auto)")
    refused = [e for e in errors_of("""
        kv: {host_cache: 64}
        decode:
          speculative: {method: draft, draft_model: /m}
    """) if e[0] == "kv.host_cache"]  # (besides /m missing here)
    assert refused == [("kv.host_cache", 1, "does not work with a draft model (decode.speculative.method draft: the prefill "
              "and decode workers load one, and its KV cache has no host tier); set it to null or use method ngram")]


def test_validate_prints_speculation_back(tmp_path, capsys):
    code, out, _ = run_validate(write(tmp_path, "decode:\n  speculative: {num_tokens: 8}\n"), capsys)
    assert code == 0 and yaml.safe_load(out)["decode"]["speculative"] == dict(
        method="ngram", num_tokens=8, adaptive=True, ngram_min=2, ngram_max=4, draft_model=None,
        draft_prompt_kv="auto")


def test_validate_checks_a_draft_model_against_the_model(tmp_path, capsys, checkpoint, draft_checkpoint):
    """The draft must exist and share the model's tokenizer; each mistake names the key and line."""
    target = checkpoint("llama")
    good, other_tokenizer = draft_checkpoint("llama"), draft_checkpoint("llama", vocab_size=400)

    def validate(draft) -> tuple[int, str, str]:
        text = f"model:\n  path: {target}\ndecode:\n  speculative:\n    method: draft\n    draft_model: {draft}\n"
        return run_validate(write(tmp_path, text), capsys)

    code, out, _ = validate(good)
    assert code == 0 and yaml.safe_load(out)["decode"]["speculative"]["draft_model"] == str(good)
    where = f"{tmp_path / 't.yaml'}:6: decode.speculative.draft_model"
    code, _, err = validate(tmp_path / "missing")
    assert code != 0 and err.strip() == (f"{where}: {tmp_path / 'missing'} does not exist here: give a local model "
                                         "directory or .gguf file with the model's tokenizer")
    code, _, err = validate(other_tokenizer)
    assert code != 0 and err.strip() == (f"{where}: the draft's tokenizer differs from the model's (another "
                                         "vocabulary); give a draft with the model's tokenizer")


@pytest.mark.parametrize("text, key, message", [
    ("decode:\n  speculative: {num_tokens: 0}\n", "decode.speculative.num_tokens",
     "must be an integer in 1..16 or null; got 0"),
    ("decode:\n  speculative: {num_tokens: 17}\n", "decode.speculative.num_tokens",
     "must be an integer in 1..16 or null; got 17"),
    ("decode:\n  speculative: {num_tokens: '4'}\n", "decode.speculative.num_tokens",
     "must be an integer in 1..16 or null; got '4' (a string)"),
    ("decode:\n  speculative: {method: draft}\n", "decode.speculative.draft_model",
     "is required with method draft: the path of a smaller model with the model's tokenizer"),
    ("decode:\n  speculative: {draft_model: /models/small}\n", "decode.speculative.draft_model",
     "is read only with method draft (method is ngram); remove it or set method: draft"),
    ("decode:\n  speculative: {method: eagle}\n", "decode.speculative.method",
     "must be one of ngram, draft; got 'eagle' (a string)"),
    ("decode:\n  speculative: {adaptive: sometimes}\n", "decode.speculative.adaptive",
     "must be true or false; got 'sometimes' (a string)"),
    ("decode:\n  speculative: {ngram_max: 65}\n", "decode.speculative.ngram_max",
     "must be an integer in 1..64; got 65"),
    ("decode:\n  speculative: {ngram_min: 5}\n", "decode.speculative.ngram_min",
     "must not exceed ngram_max (4); got 5"),
    ("decode:\n  speculative: {num_token: 4}\n", "decode.speculative.num_token",
     "unknown key; did you mean 'num_tokens'? known: adaptive, draft_model, draft_prompt_kv, method, ngram_max, ngram_min, num_tokens"),
    ("decode:\n  speculative: true\n", "decode.speculative",
     "must be a mapping with the keys adaptive, draft_model, draft_prompt_kv, method, ngram_max, ngram_min, "
     "num_tokens; got true"),
    ("decode:\n  speculative: {draft_prompt_kv: prefill}\n", "decode.speculative.draft_prompt_kv",
     "is read only with method draft (method is ngram); remove it or set method: draft"),
    ("decode:\n  speculative: {draft_prompt_kv: there}\n",
     "decode.speculative.draft_prompt_kv", "must be one of auto, decode, prefill; got 'there' (a string)"),
    ("prefill:\n  speculative: {}\n", "prefill.speculative",
     "prefill workers never speculate (each request leaves them at its first token); set it on decode or "
     "colocated"),
])
def test_speculative_mistakes(text, key, message):
    assert only_error(text) == (key, 2, message)


# -- mistakes, each with its key and line ---------------------------------------------------

def test_not_yaml():
    key, line, message = only_error("""
        prefill:
          tp: [1, 2
        decode: {}
    """)
    assert (key, line) == ("", 3) and message.startswith("not valid YAML")


def test_top_level_not_a_mapping():
    key, line, message = only_error("- prefill\n- decode\n")
    assert key == "" and "top level must be a mapping" in message and "a list" in message
    assert only_error("just a string")[2].endswith("got 'just a string' (a string)")


def test_two_documents_are_not_one_topology():
    key, line, message = only_error("cluster: {name: a}\n---\ncluster: {name: b}\n")
    assert (key, line) == ("", 2) and "single document" in message


def test_section_not_a_mapping():
    assert only_error("kv: 16\n")[:2] == ("kv", 1)
    assert only_error("prefill:\n  node: [gpus]\n")[:2] == ("prefill.node", 2)


@pytest.mark.parametrize("text, key, line", [
    ("prefil:\n  tp: 2\n", "prefil", 1),
    ("cluster:\n  nmae: x\n", "cluster.nmae", 2),
    ("model:\n  revision: main\n", "model.revision", 2),
    ("decode:\n  tp: 1\n  replica: 2\n", "decode.replica", 3),
    ("prefill:\n  node:\n    gpu: 8\n", "prefill.node.gpu", 3),
    ("kv:\n  blocksize: 16\n", "kv.blocksize", 2),
    ("registry:\n  host: r\n", "registry.host", 2),
    ("server:\n  tls:\n    ca_file: x\n", "server.tls.ca_file", 3),
    ("observability:\n  grafana: true\n", "observability.grafana", 2),
    ("ray:\n  namespace: x\n", "ray.namespace", 2),
    ("router:\n  polciy: slo\n", "router.polciy", 2),
    ("router:\n  slo_classes:\n    a:\n      ttft: 1\n", "router.slo_classes.a.ttft", 4),
])
def test_unknown_keys(text, key, line):
    got_key, got_line, message = only_error(text)
    assert (got_key, got_line) == (key, line)
    assert "unknown key" in message and "known:" in message


def test_unknown_key_suggests_and_lists_the_known():
    message = only_error("prefill:\n  replica: 2\n")[2]
    assert message == ("unknown key; did you mean 'replicas'? known: cpus_per_rank, gpus_per_rank, "
                       "max_num_batched_tokens, max_num_seqs, node, replicas, speculative, threads, tp")


@pytest.mark.parametrize("text, key, line, fragment", [
    ("prefill:\n  replicas: true\n", "prefill.replicas", 2, "must be an integer >= 0; got true"),
    ("decode:\n  tp: \"2\"\n", "decode.tp", 2, "got '2' (a string)"),
    ("decode:\n  tp: 2.0\n", "decode.tp", 2, "must be an integer"),
    ("prefill:\n  replicas: 0\n", "prefill.replicas", 2, "decode workers need prefill workers (at least 1)"),
    ("prefill:\n  replicas: 0\ndecode:\n  replicas: 0\n", "decode.replicas", 4, "no worker generates"),
    ("decode:\n  replicas: 0\n", "decode.replicas", 2, "prefill workers need decode workers"),
    ("prefill:\n  cpus_per_rank: 0\n", "prefill.cpus_per_rank", 2, "must be a number > 0"),
    ("prefill:\n  threads: -1\n", "prefill.threads", 2, "or null"),
    ("prefill:\n  node:\n    gpus: -1\n", "prefill.node.gpus", 3, ">= 0"),
    ("prefill:\n  node:\n    resources: {GPU: 1}\n", "prefill.node.resources.GPU", 3, "gpus_per_rank"),
    ("decode:\n  node:\n    resources:\n      a: 0\n", "decode.node.resources.a", 4, "must be a number > 0"),
    ("cluster:\n  name: My_Cluster\n", "cluster.name", 2, "a-z, 0-9 and '-'"),
    ("cluster:\n  name: -x\n", "cluster.name", 2, "starting and ending"),
    ("model:\n  dtype: fp8\n", "model.dtype", 2, "float32, bfloat16, float16"),
    ("model:\n  max_model_len: 0\n", "model.max_model_len", 2, ">= 1"),
    ("model:\n  path: 3\n", "model.path", 2, "non-empty string"),
    ("kv:\n  cache_memory_fraction: 0.96\n", "kv.cache_memory_fraction", 2, "(0, 0.95]"),
    ("kv:\n  cache_memory_fraction: 0\n", "kv.cache_memory_fraction", 2, "(0, 0.95]"),
    ("kv:\n  prefix_caching: \"yes\"\n", "kv.prefix_caching", 2, "true or false"),
    ("kv:\n  prefix_caching: 1\n", "kv.prefix_caching", 2, "true or false"),
    ("kv:\n  block_size: 0\n", "kv.block_size", 2, ">= 1"),
    ("kv:\n  transfer_timeout_s: -1\n", "kv.transfer_timeout_s", 2, "> 0"),
    ("server:\n  port: 70000\n", "server.port", 2, "0..65535"),
    ("server:\n  host: \"\"\n", "server.host", 2, "non-empty string"),
    ("server:\n  auth_token_env: my-token\n", "server.auth_token_env", 2, "environment variable name"),
    ("observability:\n  dashboard: \"on\"\n", "observability.dashboard", 2, "true or false"),
    ("observability:\n  dashboard_port: 0\n", "observability.dashboard_port", 2, "1..65535"),
    ("observability:\n  metrics_export_port: 65536\n", "observability.metrics_export_port", 2, "1..65535"),
    ("registry:\n  url: http://r:6379\n", "registry.url", 2, "the scheme is http"),
    ("registry:\n  url: redis://r:port/0\n", "registry.url", 2, "port"),
    ("registry:\n  url: redis://r:6379/zero\n", "registry.url", 2, "database"),
    ("registry:\n  password_env: 1PASS\n", "registry.password_env", 2, "environment variable name"),
    ("ray:\n  num_cpus: 0\n", "ray.num_cpus", 2, ">= 1"),
])
def test_wrong_types_and_ranges(text, key, line, fragment):
    got_key, got_line, message = only_error(text)
    assert (got_key, got_line) == (key, line)
    assert fragment in message


def test_the_observability_dashboard_on_is_yaml_true():
    """YAML 1.1 reads an unquoted `on` as true."""
    assert parse_topology("observability: {dashboard: on}").observability.dashboard is True


def test_registry_url_messages_never_show_the_password():
    message = only_error("registry:\n  url: http://:s3cret@r:6379/0\n")[2]
    assert "s3cret" not in message


def test_tp_does_not_fit_a_node():
    assert only_error("""
        prefill:
          tp: 3
          gpus_per_rank: 1
          node:
            gpus: 2
    """) == ("prefill.tp", 2, "3 ranks of 1 GPU do not fit on a node of 2 GPUs")
    assert only_error("""
        decode:
          gpus_per_rank: 1
          node: {gpus: 0}
    """)[::2] == ("decode.tp", "1 rank of 1 GPU does not fit on a node of 0 GPUs")
    parse_topology("prefill: {tp: 3, gpus_per_rank: 0, node: {gpus: 2}}")  # CPU ranks need no GPUs
    parse_topology("prefill: {tp: 3, gpus_per_rank: 1, node: {gpus: 8}}")


def test_gpus_per_rank_is_zero_or_one():
    key, line, message = only_error("decode:\n  tp: 3\n  gpus_per_rank: 2\n  node: {gpus: 3}\n")
    assert (key, line) == ("decode.gpus_per_rank", 3)
    assert message == "must be one of 0 (CPU ranks) or 1 (one GPU per rank); got 2"


def test_tp_must_divide_the_model(tmp_path):
    directory = model_dir(tmp_path)
    errors = errors_of(f"""
        model:
          path: {directory}
        prefill:
          tp: 3
        decode:
          tp: 64
    """)
    assert [(key, line) for key, line, _ in errors] == [("prefill.tp", 4), ("decode.tp", 6)]
    assert errors[0][2] == ("tensor-parallel size 3 does not divide this model's 32 attention heads, "
                            "8 KV heads (neither divides the other), MLP size 14336")
    assert errors[1][2] == "tensor-parallel size 64 does not divide this model's 32 attention heads"
    spec = parse_topology(f"model: {{path: {directory}}}\nprefill: {{tp: 8}}\ndecode: {{tp: 4}}\n")
    assert spec.model.name == "llama-8b"


def test_tp_against_a_real_checkpoint(checkpoint):
    directory = checkpoint("llama")  # 4 heads, 2 KV heads, MLP 128
    key, line, message = only_error(f"model:\n  path: {directory}\ndecode:\n  tp: 3\n")
    assert (key, line) == ("decode.tp", 4) and "4 attention heads" in message
    assert parse_topology(f"model:\n  path: {directory}\nprefill:\n  tp: 4\n").prefill.tp == 4


def test_max_model_len_beyond_the_model(tmp_path):
    directory = model_dir(tmp_path, max_position_embeddings=8192)
    assert only_error(f"model:\n  path: {directory}\n  max_model_len: 16384\n") == (
        "model.max_model_len", 3, "16384 exceeds the model's max_position_embeddings 8192")


def test_quantization_needs_a_kernel_on_the_pool_and_a_float_checkpoint(checkpoint):
    """A GPU pool runs the engine's default backend, Triton, whose kernels read quantized weights."""
    assert only_error("model:\n  quantization: int4\n") == (
        "model.quantization", 2, "prefill pool (cpu): quantization int4: the GGUF file is already quantized; "
        "use auto (served as shipped) or none (widened)")
    directory = checkpoint("llama")
    on_gpu = parse_topology(f"model:\n  path: {directory}\n  quantization: int8\ndecode:\n  gpus_per_rank: 1\n")
    assert on_gpu.pool("decode").device.startswith("cuda") and on_gpu.model.quantization == "int8"
    assert parse_topology(f"model:\n  path: {directory}\n  quantization: int8\n").model.quantization == "int8"


def test_an_8bit_kv_cache_is_read_on_cpu_and_gpu_pools():
    spec = parse_topology("kv:\n  cache_dtype: fp8_e4m3\ndecode:\n  gpus_per_rank: 1\n")
    assert spec.decode.device.startswith("cuda") and spec.engine_args("decode")["kv_cache_dtype"] == "fp8_e4m3"
    spec = parse_topology("kv:\n  cache_dtype: int8\n")
    assert spec.engine_args("decode")["kv_cache_dtype"] == "int8"


def test_a_quantized_hugging_face_checkpoint_is_not_quantized_again(checkpoint, tmp_path):
    from hf_quantized_files import write_quantized

    directory = tmp_path / "fp8-channel"
    write_quantized(checkpoint("llama"), directory, "compressed-tensors", strategy="channel")
    assert only_error(f"model:\n  path: {directory}\n  quantization: fp8\n") == (
        "model.quantization", 3, "prefill pool (cpu): quantization fp8: the checkpoint (compressed-tensors) is "
        "already quantized; use auto (served as shipped) or none (widened)")
    assert parse_topology(f"model:\n  path: {directory}\n  quantization: auto\n").model.quantization == "auto"
    assert parse_topology(f"model:\n  path: {directory}\ndecode:\n  gpus_per_rank: 1\n").model.path == str(directory)


def test_missing_model_path_is_an_error_naming_its_line(tmp_path):
    path = write(tmp_path, """
        cluster:
          name: t
        model:
          path: /nonexistent/llama
    """)
    spec, errors, warnings = validate_file(path)
    assert spec is None and warnings == []
    assert [e.format(str(path)) for e in errors] == [
        f"{path}:4: model.path: /nonexistent/llama does not exist here: give a local Hugging Face-format model "
        "directory (or null for the default model)"]


@pytest.mark.parametrize("joins_a_cluster", [False, True])
def test_missing_model_path_is_a_warning_where_the_model_is_elsewhere(tmp_path, joins_a_cluster):
    """With ray.address the cluster's nodes hold the model; `tandem validate --model-elsewhere`
    checks a file away from its machines."""
    text = "model:\n  path: /nonexistent/llama\nprefill:\n  tp: 3\n"
    path = write(tmp_path, text + ("ray:\n  address: head:6379\n" if joins_a_cluster else ""))
    spec, errors, warnings = validate_file(path, model_elsewhere=not joins_a_cluster)
    assert errors == [] and spec.prefill.tp == 3
    assert warnings == [f"{path}:2: model.path: /nonexistent/llama does not exist here; tp and max_model_len "
                        "are checked against the model only where it is readable"]


def test_default_model_heads_are_checked_before_it_is_built(tmp_path, monkeypatch):
    """The default model (SmolLM2-135M: 9 attention heads, 3 KV heads, MLP 1536, context 8192)
    is known without fetching it: TP 2 and a longer context are errors with their lines."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert errors_of("""
        cluster:
          name: t
        prefill:
          tp: 2
        decode:
          tp: 3
        model:
          max_model_len: 16384
    """) == [
        ("prefill.tp", 4, "tensor-parallel size 2 does not divide this model's 9 attention heads, 3 KV heads "
                          "(neither divides the other)"),
        ("model.max_model_len", 8, "16384 exceeds the model's max_position_embeddings 8192"),
    ]
    assert not (tmp_path / "empty-cache").exists()  # nothing was fetched
    assert parse_topology("prefill:\n  tp: 3\ndecode:\n  tp: 3\n").decode.tp == 3


def test_model_path_that_is_not_a_model(tmp_path):
    key, line, message = only_error(f"model:\n  path: {tmp_path}\n")
    assert (key, line) == ("model.path", 2) and "no config.json" in message
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "architectures": ["GPT2LMHeadModel"]}))
    key, line, message = only_error(f"model:\n  path: {tmp_path}\n")
    assert (key, line) == ("model.path", 2) and "not supported" in message


def test_tls_needs_both_files():
    assert only_error("""
        server:
          host: 0.0.0.0
          tls:
            cert_file: /etc/tls/cert.pem
    """) == ("server.tls", 3, "needs both cert_file and key_file; key_file is missing")
    assert only_error("server:\n  tls:\n    key_file: k.pem\n")[::2] == (
        "server.tls", "needs both cert_file and key_file; cert_file is missing")
    assert parse_topology("server: {tls: {cert_file: null, key_file: null}}").server.tls is None


def test_auth_token_from_env_or_file_not_both():
    assert only_error("""
        server:
          auth_token_env: TANDEM_TOKEN
          auth_token_file: /etc/tandem/token
    """) == ("server.auth_token_file", 3, "give auth_token_env or auth_token_file, not both")


def test_unknown_transport():
    assert only_error("kv:\n  block_size: 16\n  transport: carrier-pigeon\n") == (
        "kv.transport", 3, "unknown KV transport 'carrier-pigeon'; known: torch_distributed")


@pytest.mark.parametrize("text, key, line, fragment", [
    ("router:\n  policy: slo\n  weights:\n    cache: 1\n", "router.weights.cache", 4, "unknown scorer"),
    ("router:\n  weights:\n    least_loaded: -1\n", "router.weights.least_loaded", 3, ">= 0"),
    ("router:\n  policy: fastest\n", "router.policy", 2, "unknown policy 'fastest'"),
    ("router:\n  slo_classes:\n    a:\n      on_overload: drop\n  default_class: a\n",
     "router.slo_classes.a.on_overload", 4, "reject, queue, admit"),
    ("router:\n  slo_classes:\n    a: {ttft_ms: 0}\n  default_class: a\n", "router.slo_classes.a.ttft_ms", 3,
     "positive number"),
    ("router:\n  default_class: premium\n", "router.default_class", 2, "unknown slo_class 'premium'"),
    ("router:\n  skip_prefill_fraction: 1.5\n", "router.skip_prefill_fraction", 2, "(0, 1]"),
    ("router:\n  weights: 3\n", "router.weights", 2, "a mapping of scorer name to weight"),
    ("router:\n  admission_control: \"no\"\n", "router.admission_control", 2, "true or false"),
    ("router:\n  slo_classes: [a, b]\n", "router.slo_classes", 2, "a mapping of class name"),
    ("router: [slo]\n", "router", 1, "must be a mapping"),
])
def test_router_errors(text, key, line, fragment):
    got_key, got_line, message = only_error(text)
    assert (got_key, got_line) == (key, line)
    assert fragment in message


def test_registry_password_in_one_place(tmp_path):
    assert only_error("registry:\n  url: redis://:pw@r:6379/0\n  password_env: PW\n")[:2] == (
        "registry.password_env", 3)
    spec, errors, warnings = validate_file(write(tmp_path, "registry:\n  url: redis://:pw@r:6379/0\n"))
    assert errors == [] and spec.registry.url == "redis://:pw@r:6379/0"
    assert warnings == [f"{tmp_path / 't.yaml'}:2: registry.url: holds a password in the file; prefer password_env"]


def test_num_cpus_only_for_a_local_ray():
    assert only_error("ray:\n  address: auto\n  num_cpus: 4\n")[:2] == ("ray.num_cpus", 3)


def test_ports_must_differ():
    assert only_error("""
        server: {port: 8265}
        observability:
          dashboard: true
    """)[:2] == ("observability.dashboard_port", 2)
    parse_topology("server: {port: 8265}\nobservability: {dashboard: false}\n")
    assert only_error("observability:\n  metrics_export_port: 50051\n") == (
        "observability.metrics_export_port", 2, "port 50051 is taken by server.port")


def test_duplicate_keys():
    assert only_error("prefill:\n  tp: 1\n  tp: 3\n") == ("prefill.tp", 3, "duplicate key (first on line 2)")


def test_every_error_of_a_file_is_reported_in_line_order():
    errors = errors_of("""
        cluster:
          name: Prod
        prefill:
          replicas: 0
          tp: 3
          gpus_per_rank: 1
          node: {gpus: 2}
        decode:
          tp: "1"
          colour: blue
        kv:
          transport: nope
        router:
          weights: {cache: 1}
        server:
          tls: {cert_file: c.pem}
          auth_token_env: T
          auth_token_file: t
        extra: 1
    """)
    assert [(key, line) for key, line, _ in errors] == [
        ("cluster.name", 2), ("prefill.replicas", 4), ("prefill.tp", 5), ("decode.tp", 9), ("decode.colour", 10),
        ("kv.transport", 12), ("router.weights.cache", 14), ("server.tls", 16), ("server.auth_token_file", 18),
        ("extra", 19),
    ]


def test_error_text_is_one_line_per_issue():
    with pytest.raises(TopologyError) as info:
        parse_topology("prefill:\n  tp: 0\nbogus: 1\n", "site.yaml")
    assert isinstance(info.value, ValueError)
    assert str(info.value).splitlines() == [
        "site.yaml:2: prefill.tp: must be an integer >= 1; got 0",
        "site.yaml:3: bogus: unknown key; known: cluster, colocated, decode, kv, model, observability, planner, prefill, ray, "
        "registry, "
        "router, server",
    ]
    assert TopologyIssue("kv", None, "x").format("f.yaml") == "f.yaml: kv: x"
    assert TopologyIssue("", 3, "x").format("f.yaml") == "f.yaml:3: x"


def test_load_topology_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(TopologyError, match=f"^{missing}: no such file$") as info:
        load_topology(missing)
    assert info.value.errors == [TopologyIssue("", None, "no such file")]


def test_exposure_warnings(tmp_path):
    path = write(tmp_path, """
        server:
          host: 0.0.0.0
        observability:
          dashboard: true
          dashboard_host: 0.0.0.0
        prefill:
          node: {resources: {big: 1}}
    """)
    spec, errors, warnings = validate_file(path)
    assert errors == []
    assert [w.split(": ")[1] for w in warnings] == [
        "server.host", "server.host", "observability.dashboard_host", "prefill.node.resources"]
    assert "no auth token" in warnings[0] and "without TLS" in warnings[1]


# -- tandem validate ------------------------------------------------------------------------

def test_validate_prints_the_normalised_topology(tmp_path, capsys):
    path = write(tmp_path, "prefill:\n  replicas: 2\n")
    code, out, err = run_validate(path, capsys)
    assert (code, err) == (0, "")
    assert out == parse_topology("prefill:\n  replicas: 2\n").to_yaml()
    assert yaml.safe_load(out)["prefill"]["replicas"] == 2
    assert yaml.safe_load(out)["kv"]["block_size"] == 16
    assert parse_topology(out) == load_topology(path)


def test_validate_prints_warnings_to_stderr(capsys):
    code, out, err = run_validate(EXAMPLES[0], capsys, "--model-elsewhere")
    assert code == 0 and out.startswith("cluster:\n  name: llama-8b\n")
    assert f"warning: {EXAMPLES[0]}:11: model.path: /models/llama-3.1-8b-instruct does not exist here" in err


def test_validate_reports_every_error(tmp_path, capsys):
    path = write(tmp_path, "prefill:\n  tp: 0\ndecode:\n  replicas: x\n")
    code, out, err = run_validate(path, capsys)
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"{path}:2: prefill.tp: must be an integer >= 1; got 0",
        f"{path}:4: decode.replicas: must be an integer >= 0; got 'x' (a string)",
    ]


def test_validate_missing_file(tmp_path, capsys):
    code, out, err = run_validate(tmp_path / "absent.yaml", capsys)
    assert (code, out, err) == (1, "", f"{tmp_path / 'absent.yaml'}: no such file\n")


def test_validate_not_yaml(tmp_path, capsys):
    path = write(tmp_path, "prefill: {tp: 2\n")
    code, out, err = run_validate(path, capsys)
    assert code == 1 and err.startswith(f"{path}:2: not valid YAML")


def test_topology_error_crosses_processes_whole():
    """A TopologyError raised in an actor reaches `tandem up` through pickling with its issues."""
    import pickle

    with pytest.raises(TopologyError) as info:
        parse_topology("prefill:\n  tp: 0\n", "t.yaml")
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.errors == info.value.errors and str(copy) == str(info.value)
    assert str(copy).startswith("t.yaml:2: prefill.tp: ")


def test_the_live_planner_s_keys_are_checked():
    spec = parse_topology("planner: {mode: act, decode_max: 3, cooldown_s: 60}\n")
    assert (spec.planner.mode, spec.planner.decode_max, spec.planner.cooldown_s, spec.planner.confirmations) == (
        "act", 3, 60.0, 2)
    for text, message in (
            ("planner: {mode: auto}", "planner.mode: must be one of off, advise, act"),
            ("planner: {prefill_min: 2, prefill_max: 1}", "planner.prefill_max: must be at least prefill_min (2), got 1"),
            ("planner: {max_workers: 2, prefill_min: 2}", "planner.max_workers: must be at least prefill_min + "
                                                          "decode_min (3), got 2"),
            ("planner: {window_s: 300}", "planner.window_s:"),
            ("planner: {mode: advise}\ncolocated: {replicas: 1}", "planner.mode: advise sizes prefill and decode pools"),
    ):
        with pytest.raises(TopologyError, match=re.escape(message)):
            parse_topology(text)


# -- the spec `tandem up` starts Ray with, before the model's check -------------------------------

def test_spec_before_model_check_is_the_checked_spec_less_the_models_errors(tmp_path, monkeypatch):
    """`tandem up` starts Ray with it while the model is checked (that check imports torch):
    the same spec the full check gives; errors only the model shows are left to that check; a
    missing model path, an unreadable file or any other error gives None (checked at once)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert spec_before_model_check(None) == default_topology()
    long = tmp_path / "long.yaml"
    long.write_text("cluster:\n  name: t\nmodel:\n  max_model_len: 16384\n")
    with pytest.raises(TopologyError, match="16384 exceeds the model's max_position_embeddings 8192"):
        load_topology(long)
    early = spec_before_model_check(long)
    assert (early.name, early.model.max_model_len) == ("t", 16384)
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"model:\n  path: {tmp_path / 'no-model'}\n")
    assert spec_before_model_check(missing) is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  tp: zero\n")
    assert spec_before_model_check(bad) is None
    assert spec_before_model_check(tmp_path / "absent.yaml") is None
    assert not (tmp_path / "empty-cache").exists()  # nothing was fetched
