"""``tandem run`` end to end: the real console script in a subprocess, a JSONL file of good and
bad requests in, one result line per request out, in input order, matching the Python API."""

from __future__ import annotations

import io
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from cluster.offline.run_file import run_file
from conftest import random_prompts

pytestmark = pytest.mark.e2e

_SCRIPT = Path(sys.executable).parent / "tandem"
TANDEM = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "cluster.cli.main"]

# Long enough for two full blocks of 16 tokens (a prefix-cache hit needs a full block before the last token).
LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. A function returns a value. Classes define objects; "
    "modules hold functions and classes. Tandem serves models. 東京 and 大阪 are cities. 🙂 done."
)
STOP_PROMPT = "Émile écrit «bonjour» — naïve café déjà vu."
SEEDED_PROMPT = "Tandem serves models."
IDS_PROMPT = random_prompts([20], seed=7)[0]

GREEDY = dict(temperature=0, ignore_eos=True)
SEEDED = dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, seed=1234, repetition_penalty=1.1,
              presence_penalty=0.2, frequency_penalty=0.1, ignore_eos=True, max_tokens=8)
STOP_SOURCE_TOKENS = 24


def _run(*args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*TANDEM, "run", *args], input=stdin, capture_output=True, timeout=timeout, env=env)


def _choose_stop(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[str, int, str]:
    """A stop string that spans tokens and is completed by token ``k`` of a greedy answer:
    the last two characters before token k plus the first character token k adds.
    Returns (stop, k, the text the answer must be cut to)."""
    detok = IncrementalDetokenizer(tokenizer)
    texts = []
    for t in token_ids:
        detok.append(t)
        texts.append(detok.text)
    for k in range(2, len(token_ids) - 2):
        before, after = texts[k - 1], texts[k]
        if len(before) < 2 or len(after) == len(before):
            continue
        start = len(before) - 2
        stop = after[start : len(before) + 1]
        if "\ufffd" in stop or stop.isspace() or after.find(stop) != start:
            continue
        if stop in tokenizer.decode(token_ids[k : k + 1]):
            continue
        return stop, k, after[:start]
    raise AssertionError(f"no usable stop string in {texts[-1]!r}")


@pytest.fixture(scope="module")
def model_dir(checkpoint) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> dict:
    """Results of the Python API for the good lines of the input file."""
    llm = LLM(str(model_dir), verbose=False)
    tokenizer = llm.engine.tokenizer
    text, ids, seeded, stop_source = llm.generate(
        [LONG_TEXT, IDS_PROMPT, SEEDED_PROMPT, STOP_PROMPT],
        [
            SamplingParams(max_tokens=8, **GREEDY),
            SamplingParams(max_tokens=6, logprobs=2, **GREEDY),
            SamplingParams(**SEEDED),
            SamplingParams(max_tokens=STOP_SOURCE_TOKENS, **GREEDY),
        ],
    )
    stop, k, cut_text = _choose_stop(tokenizer, stop_source.token_ids)
    stop_token = ids.token_ids[2]
    return {
        "llm": llm,
        "tokenizer": tokenizer,
        "text": text,
        "ids": ids,
        "seeded": seeded,
        "stop": (stop, stop_source.token_ids[: k + 1], cut_text),
        "stoptok": ids.token_ids[: ids.token_ids.index(stop_token) + 1],
        "stop_token": stop_token,
    }


BROKEN_JSON = '{"id": "broken", "prompt": "no closing brace"'


def _input_lines(reference: dict) -> list[tuple[str, str | int | None, bytes]]:
    """(key, expected output id, raw line) in file order; an integer id comes back an integer."""
    stop = reference["stop"][0]
    lines = [
        ("text", "text", {"id": "text", "prompt": LONG_TEXT, "max_tokens": 8, **GREEDY}),
        ("17", 17, {"id": 17, "prompt_token_ids": IDS_PROMPT, "max_tokens": 6, "logprobs": 2, **GREEDY}),
        ("broken", None, BROKEN_JSON),
        ("seeded", "seeded", {"id": "seeded", "prompt": SEEDED_PROMPT, **SEEDED}),
        ("unknown", "unknown", {"id": "unknown", "prompt": "hi", "temprature": 0.5}),
        ("stop", "stop", {"id": "stop", "prompt": STOP_PROMPT, "max_tokens": STOP_SOURCE_TOKENS, "stop": [stop],
                          **GREEDY}),
        ("long", "long", {"id": "long", "prompt_token_ids": [5] * 600, "max_tokens": 4}),
        ("dup", "text", {"id": "text", "prompt": "a duplicate id"}),
        ("both", "both", {"id": "both", "prompt": "hi", "prompt_token_ids": [5, 6]}),
        ("oov", "oov", {"id": "oov", "prompt_token_ids": [5, 6, 512]}),
        ("badtemp", "badtemp", {"id": "badtemp", "prompt": "hi", "temperature": -1}),
        ("stoptok", "stoptok", {"id": "stoptok", "prompt_token_ids": IDS_PROMPT, "max_tokens": 6,
                                "stop_token_ids": [reference["stop_token"]], **GREEDY}),
        ("latin1", None, '{"id": "latin1", "prompt": "caf\xe9"}'.encode("latin-1")),
        ("surrogate", "surrogate", '{"id": "surrogate", "prompt": "half \\ud83d of an emoji"}'),
        # The id of a line that failed is still taken.
        ("dup_of_failed", "unknown", {"id": "unknown", "prompt": "hi"}),
        # Same prompt as line 1 at a lower priority: admitted after line 1 when the token budget is tight.
        ("shared", "shared", {"id": "shared", "prompt": LONG_TEXT, "max_tokens": 8, "priority": -1, **GREEDY}),
        ("stopoov", "stopoov", {"id": "stopoov", "prompt": "hi", "stop_token_ids": [512]}),
    ]
    encoded = []
    for key, expected_id, line in lines:
        if isinstance(line, dict):
            line = json.dumps(line, ensure_ascii=False)
        encoded.append((key, expected_id, line if isinstance(line, bytes) else line.encode("utf-8")))
    return encoded


ERRORS = {
    # line key -> words its error message must contain
    "broken": ["line 3", "malformed JSON", f"column {len(BROKEN_JSON) + 1}"],
    "unknown": ["line 5", "temprature"],
    "long": ["line 7", "600", "context"],
    "dup": ["line 8", "duplicate", "'text'"],
    "both": ["line 9", "prompt", "prompt_token_ids"],
    "oov": ["line 10", "prompt_token_ids", "512"],
    "badtemp": ["line 11", "temperature"],
    "latin1": ["line 13", "UTF-8"],
    "surrogate": ["line 14", "prompt", "Unicode"],
    "dup_of_failed": ["line 15", "duplicate", "'unknown'"],
    "stopoov": ["line 17", "stop_token_ids must be in [0, 512)"],
}
GOOD = {"text", "17", "seeded", "stop", "stoptok", "shared"}


@pytest.fixture(scope="module")
def input_file(tmp_path_factory, reference) -> tuple[Path, list[str], list[str | None]]:
    path = tmp_path_factory.mktemp("cli") / "in.jsonl"
    lines = _input_lines(reference)
    path.write_bytes(b"".join(raw + b"\n" for _, _, raw in lines))
    return path, [k for k, _, _ in lines], [i for _, i, _ in lines]


def _run_file(model_dir: Path, input_file, tmp_path: Path, *flags: str, stdio: bool = False) -> dict[str, dict]:
    """Runs the file through the console script (through a file, or stdin and stdout); returns the
    output rows by line key."""
    path, keys, ids = input_file
    out = tmp_path / "out.jsonl"
    if stdio:
        result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--quiet", *flags,
                      stdin=path.read_bytes())
        stdout = result.stdout.decode("utf-8")
    else:
        result = _run("--model", str(model_dir), "--input", str(path), "--output", str(out), "--quiet", *flags)
        stdout = out.read_text(encoding="utf-8")
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 0, stderr
    assert f"wrote {'-' if stdio else out}" in stderr
    assert "Traceback" not in stderr
    assert "Token authentication" not in stderr  # Ray's notice; Tandem keeps token auth on, quietly
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert len(rows) == len(ids)
    assert [r["id"] for r in rows] == ids  # one line per input line, in input order
    for row in rows:
        assert set(row) >= {"id", "token_ids", "text", "finish_reason", "usage", "error"}
        assert set(row["usage"]) == {"prompt_tokens", "cached_tokens", "completion_tokens"}
    return dict(zip(keys, rows))


def _check_rows(by_id: dict[str, dict], reference: dict) -> dict[str, dict]:
    assert set(by_id) == set(ERRORS) | GOOD
    tokenizer = reference["tokenizer"]

    for key, words in ERRORS.items():
        row = by_id[key]
        assert row["finish_reason"] == "error", row
        assert row["token_ids"] == [] and row["text"] == ""
        for word in words:
            assert word in row["error"], (word, row["error"])

    good = {k: v for k, v in by_id.items() if k in GOOD}
    prompt_lengths = {
        "text": len(tokenizer.encode(LONG_TEXT)), "shared": len(tokenizer.encode(LONG_TEXT)),
        "17": len(IDS_PROMPT), "stoptok": len(IDS_PROMPT),
        "seeded": len(tokenizer.encode(SEEDED_PROMPT)), "stop": len(tokenizer.encode(STOP_PROMPT)),
    }
    for key, row in good.items():
        assert row["error"] is None, row
        assert row["finish_reason"] in ("length", "stop"), row
        usage = row["usage"]
        assert usage["prompt_tokens"] == prompt_lengths[key]
        assert usage["completion_tokens"] == len(row["token_ids"]) > 0
        assert 0 <= usage["cached_tokens"] < usage["prompt_tokens"]

    # Greedy lines give exactly the Python API's tokens and text.
    for key, ref in (("text", reference["text"]), ("shared", reference["text"]), ("17", reference["ids"])):
        assert good[key]["token_ids"] == ref.token_ids, key
        assert good[key]["text"] == ref.text
        assert good[key]["finish_reason"] == "length"
    assert good["seeded"]["token_ids"] == reference["seeded"].token_ids
    assert good["seeded"]["finish_reason"] == "length"

    # logprobs=2: the sampled token's logprob and the top 2, and greedy means the sampled one is the best.
    row = good["17"]
    assert len(row["logprobs"]) == len(row["top_logprobs"]) == len(row["token_ids"])
    for token, logprob, top in zip(row["token_ids"], row["logprobs"], row["top_logprobs"]):
        assert len(top) == 2 and top[0][1] >= top[1][1]
        assert top[0][0] == token and top[0][1] == pytest.approx(logprob, abs=1e-4)
        assert logprob <= 0
    assert row["logprobs"] == pytest.approx(reference["ids"].logprobs, abs=1e-3)
    assert "logprobs" not in good["text"]

    # The stop string is cut from the text, at the token that completed it.
    stop, stop_tokens, cut_text = reference["stop"]
    assert good["stop"]["finish_reason"] == "stop"
    assert good["stop"]["token_ids"] == stop_tokens
    assert good["stop"]["text"] == cut_text
    assert stop not in good["stop"]["text"]

    assert good["stoptok"]["finish_reason"] == "stop"
    assert good["stoptok"]["token_ids"] == reference["stoptok"]
    return good


def test_run_file_with_default_flags(model_dir, input_file, reference, tmp_path):
    rows = _run_file(model_dir, input_file, tmp_path)
    _check_rows(rows, reference)


def test_run_file_with_engine_flags_and_prefix_hit(model_dir, input_file, reference, tmp_path):
    """A tight token budget makes the lower-priority duplicate prompt run after the first copy's
    prompt is computed, so it hits the prefix cache; tokens stay those of the Python API."""
    rows = _run_file(
        model_dir, input_file, tmp_path,
        "--block-size", "8", "--num-kv-blocks", "64", "--max-num-batched-tokens", "32", "--dtype", "float32",
    )
    good = _check_rows(rows, reference)
    assert good["text"]["usage"]["cached_tokens"] == 0
    cached = good["shared"]["usage"]["cached_tokens"]
    prompt = good["shared"]["usage"]["prompt_tokens"]
    assert cached > 0 and cached % 8 == 0
    assert cached == (prompt - 1) // 8 * 8


def test_run_file_with_tensor_parallel_ranks(model_dir, input_file, reference, tmp_path):
    """--tp 2: rank 1 is a Ray actor on a local Ray; the lines come out as with one rank."""
    rows = _run_file(model_dir, input_file, tmp_path, "--tp", "2", "--cluster-name", "cli-tp-test", "--threads", "1")
    _check_rows(rows, reference)


def test_run_file_disaggregated_with_prefill_tp2(model_dir, input_file, reference, tmp_path):
    """--disaggregated: a prefill worker (TP 2) and a decode worker in their own processes, KV
    streamed between them; every line as the colocated Python API gives it."""
    rows = _run_file(model_dir, input_file, tmp_path, "--disaggregated", "--prefill-tp", "2",
                     "--cluster-name", "cli-disagg-test", "--threads", "1")
    _check_rows(rows, reference)


def test_run_file_routed_by_policy_with_slo_classes(model_dir, input_file, reference, tmp_path):
    """--policy prefix_affinity over 2 prefill and 2 decode workers: the lines are those of
    the Python API, and the summary reports goodput from the registry."""
    rows = _run_file(model_dir, input_file, tmp_path, "--disaggregated", "--prefill-workers", "2",
                     "--decode-workers", "2", "--policy", "prefix_affinity", "--cluster-name", "cli-route-test",
                     "--threads", "1")
    _check_rows(rows, reference)
    lines = [{"id": "fast", "prompt_token_ids": IDS_PROMPT, "max_tokens": 4, "temperature": 0, "slo_class": "interactive"},
             {"id": "bulk", "prompt_token_ids": IDS_PROMPT, "max_tokens": 4, "temperature": 0, "slo_class": "batch"},
             {"id": "typo", "prompt_token_ids": IDS_PROMPT, "max_tokens": 4, "slo_class": "realtime"},
             {"id": 4, "prompt_token_ids": IDS_PROMPT, "max_tokens": 4, "slo_class": "x" * 10_000}]
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--quiet", "--disaggregated",
                  "--cluster-name", "cli-route-test", "--threads", "1",
                  stdin="".join(json.dumps(line) + "\n" for line in lines).encode())
    assert result.returncode == 0, result.stderr.decode()
    out = {row["id"]: row for row in map(json.loads, result.stdout.decode().splitlines())}
    assert out["fast"]["error"] is None and out["bulk"]["error"] is None
    assert out["fast"]["token_ids"] == out["bulk"]["token_ids"] == reference["ids"].token_ids[:4]
    assert out["typo"]["error"] == "line 3: unknown slo_class 'realtime'; known: interactive, standard, batch"
    assert out[4]["error"].startswith("line 4: slo_class is 10000 characters long; at most 64 are allowed: 'xxx")
    assert len(out[4]["error"]) < 250
    # Both placed requests are recorded; whether "fast" met 1 s is the machine's business, not this test's.
    assert re.search(rb"\[tandem\] goodput \(last minute\): .*attainment \d+% of 2", result.stderr), result.stderr


def test_slo_class_without_the_router_fails_its_line(model_dir):
    line = json.dumps({"id": "a", "prompt_token_ids": IDS_PROMPT, "max_tokens": 2, "slo_class": "batch"})
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--quiet", stdin=line.encode())
    assert result.returncode == 0
    assert json.loads(result.stdout)["error"] == "line 1: 'slo_class' needs the router: run with --disaggregated"


def test_a_worker_that_cannot_start_is_one_line_and_exit_2(model_dir):
    """--disaggregated with a KV cache far beyond the machine: the first worker's failure is
    one line naming it and the flag to change, with no traceback (Ray's included)."""
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--disaggregated",
                  "--num-kv-blocks", "1000000000", "--cluster-name", "cli-nostart-test", "--threads", "1", stdin=b"")
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr and "Exception raised in creation task" not in stderr
    line = next(line for line in stderr.splitlines() if line.startswith("tandem run: "))
    assert " ran out of memory while starting (" in line and line.endswith("lower --num-kv-blocks (now 1000000000)")


def test_unreachable_redis_url_exits_2(model_dir):
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--disaggregated",
                  "--redis-url", "redis://127.0.0.1:1/3", stdin=b"")
    assert result.returncode == 2
    assert b"cannot reach the registry Redis at 127.0.0.1:1 (db 3)" in result.stderr


def test_disaggregated_flags_without_disaggregated_exit_2(model_dir):
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--prefill-tp", "2", stdin=b"")
    assert result.returncode == 2
    assert b"--prefill-tp needs --disaggregated" in result.stderr
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--policy", "round_robin", stdin=b"")
    assert result.returncode == 2
    assert b"--policy needs --disaggregated" in result.stderr


def test_unknown_kv_transport_exits_2(model_dir):
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--disaggregated",
                  "--kv-transport", "rdma", stdin=b"")
    assert result.returncode == 2
    assert b"unknown KV transport 'rdma'; known: torch_distributed" in result.stderr


def test_tp_degree_that_does_not_divide_the_model_exits_2(model_dir, tmp_path):
    result = _run("--model", str(model_dir), "--input", "-", "--output", "-", "--tp", "3", stdin=b"")
    assert result.returncode == 2
    assert b"tensor-parallel size 3 does not divide" in result.stderr


def test_run_file_without_prefix_caching(model_dir, input_file, reference, tmp_path):
    rows = _run_file(
        model_dir, input_file, tmp_path, "--no-prefix-caching", "--max-num-batched-tokens", "32",
        "--kv-cache-memory-fraction", "0.05", stdio=True,
    )
    good = _check_rows(rows, reference)
    assert all(row["usage"]["cached_tokens"] == 0 for row in good.values())


def test_python_api_second_identical_prompt_hits_the_prefix_cache(reference):
    llm = reference["llm"]
    params = SamplingParams(max_tokens=2, **GREEDY)
    first = llm.generate([LONG_TEXT], params)[0]
    second = llm.generate([LONG_TEXT], params)[0]
    n = first.usage.prompt_tokens
    assert n >= 33
    assert second.usage.cached_tokens == n - 1  # full blocks, then a partial hit: all but the last token
    assert second.token_ids == first.token_ids == reference["text"].token_ids[:2]


def test_missing_input_file_exits_2(model_dir, tmp_path):
    missing = tmp_path / "nope.jsonl"
    result = _run("--model", str(model_dir), "--input", str(missing), "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode == 2
    assert str(missing) in result.stderr.decode()
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_bad_model_directory_exits_2(tmp_path, kind):
    model = tmp_path / "not-a-model"
    if kind == "empty":
        model.mkdir()
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "hi"}\n')
    result = _run("--model", str(model), "--input", str(source), "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode == 2, result.stderr.decode()
    stderr = result.stderr.decode()
    assert str(model) in stderr
    assert "Traceback" not in stderr


def test_seed_too_large_fails_only_its_line(reference):
    out = io.StringIO()
    lines = ['{"id": "big", "prompt": "hi", "seed": 18446744073709551616}\n',
             '{"id": "ok", "prompt": "hi", "max_tokens": 2}\n']
    run_file(reference["llm"], lines, out, progress=False)
    big, ok = [json.loads(line) for line in out.getvalue().splitlines()]
    assert big["finish_reason"] == "error" and "seed" in big["error"]
    assert ok["error"] is None and len(ok["token_ids"]) == 2


def test_stop_string_on_the_last_allowed_token_reports_stop(reference):
    stop, stop_tokens, cut_text = reference["stop"]
    line = {"id": "s", "prompt": STOP_PROMPT, "max_tokens": len(stop_tokens), "stop": [stop], **GREEDY}
    out = io.StringIO()
    run_file(reference["llm"], [json.dumps(line) + "\n"], out, progress=False)
    row = json.loads(out.getvalue())
    assert row["token_ids"] == stop_tokens and row["text"] == cut_text
    assert row["finish_reason"] == "stop"


def test_structured_output_lines_and_a_bad_one(reference):
    """The OpenAI API's structured-output fields on input lines; a schema that does not compile
    fails only its line, naming the field."""
    schema = {"type": "object", "properties": {"pet": {"enum": ["fox", "dog"]}}, "required": ["pet"],
              "additionalProperties": False}
    lines = [{"id": "json", "prompt": "hi", "max_tokens": 30,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
             {"id": "regex", "prompt": "hi", "max_tokens": 10, "regex": "[0-9]{2}"},
             {"id": "choice", "prompt": "hi", "max_tokens": 10, "choice": ["yes", "no"], **GREEDY},
             {"id": "lark", "prompt": "hi", "max_tokens": 10, "grammar": 'start: "a" "b"?', "grammar_syntax": "lark"},
             {"id": "bad", "prompt": "hi", "regex": "(("},
             {"id": "two", "prompt": "hi", "regex": "a", "choice": ["a"]}]
    out = io.StringIO()
    run_file(reference["llm"], [json.dumps(line) + "\n" for line in lines], out, progress=False)
    rows = {row["id"]: row for row in map(json.loads, out.getvalue().splitlines())}
    assert json.loads(rows["json"]["text"])["pet"] in ("fox", "dog")
    assert re.fullmatch("[0-9]{2}", rows["regex"]["text"]) and rows["choice"]["text"] in ("yes", "no")
    assert rows["lark"]["text"] in ("a", "ab")
    assert all(rows[i]["finish_reason"] == "stop" for i in ("json", "regex", "choice", "lark"))
    assert rows["bad"]["finish_reason"] == "error" and rows["bad"]["error"].startswith(
        "line 5: regex: the regex is not valid: ")
    assert rows["two"]["error"] == ("line 6: choice: give at most one of response_format, regex, grammar and choice "
                                    "(this request also has regex)")
