"""The public gRPC API from the client side: the Python ``TandemClient``, ``tandem generate`` and a
Node.js client written only from the .proto, each against an in-process fake ``tandem.v1.Tandem``
server (canned streams, the standard health service, a bearer-token check)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from node_client import run_node_generate
from tandem import TandemClient, TandemError
from tandem.cli_generate import add_generate_parser
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-token"
# (token ids, text) of the canned answer to a text prompt; the last message adds no tokens.
CANNED = [([10], "Hello"), ([11, 12], ", wor"), ([13], "ld")]
CANNED_TEXT = "Hello, world"
CANNED_IDS = [10, 11, 12, 13]


class FakeTandem(tandem_pb2_grpc.TandemServicer):
    """Text prompts: ``busy`` -> RESOURCE_EXHAUSTED, ``fail midway`` -> one message then UNAVAILABLE,
    ``slow`` -> a message every 0.5 s, ``endless`` -> a message every 10 ms until cancelled (it records
    the cancellation under the request id), anything else -> ``CANNED``. Token-id prompts: the ids
    echoed one per message, up to ``max_tokens``; no ids -> INVALID_ARGUMENT."""

    def __init__(self, token: str):
        self.token = token
        self.requests: list[tandem_pb2.GenerateRequest] = []
        self.time_remaining: list[float | None] = []
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(name, threading.Event())

    def _authorize(self, context) -> None:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def Generate(self, request, context):
        self._authorize(context)
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        rid = request.request_id or f"req-{len(self.requests)}"
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        if request.WhichOneof("prompt") == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: token_ids is empty")
            out = ids[:max_tokens]
            for i, t in enumerate(out):
                yield tandem_pb2.GenerateResponse(
                    request_id=rid, token_ids=[t], text=f"<{t}>",
                    prefill_worker="prefill-0" if i == 0 else "", decode_worker="decode-0" if i == 0 else "")
            yield self._last(rid, "length" if len(ids) > max_tokens else "stop", len(ids), len(out))
            return
        text = request.text
        if text == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: queue full")
        if text == "fail midway":
            yield tandem_pb2.GenerateResponse(request_id=rid, token_ids=[1], text="a")
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker decode-0 died")
        if text == "slow":
            for i in range(100):
                time.sleep(0.5)
                yield tandem_pb2.GenerateResponse(request_id=rid, token_ids=[i], text=".")
            return
        if text == "endless":
            context.add_callback(self.event(f"{rid}:callback").set)
            inactive = self.event(f"{rid}:inactive")
            i = 0
            try:
                while True:
                    time.sleep(0.01)
                    if not context.is_active():
                        inactive.set()
                        return
                    yield tandem_pb2.GenerateResponse(request_id=rid, token_ids=[i], text=f"{i} ")
                    i += 1
            finally:  # also when the server drops the generator after a failed send
                if not context.is_active():
                    inactive.set()
        for i, (ids, piece) in enumerate(CANNED):
            yield tandem_pb2.GenerateResponse(
                request_id=rid, token_ids=ids, text=piece,
                prefill_worker="prefill-0" if i == 0 else "", decode_worker="decode-0" if i == 0 else "")
        yield self._last(rid, "stop", len(text), len(CANNED_IDS))

    @staticmethod
    def _last(rid, reason, prompt_tokens, completion_tokens):
        return tandem_pb2.GenerateResponse(
            request_id=rid, finished=True, finish_reason=reason,
            usage=tandem_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=completion_tokens),
            timings=tandem_pb2.Timings(queue_ms=1.0, ttft_ms=5.0, tpot_ms=2.0, e2e_ms=11.0))

    chat = False  # whether the fake model has a chat template

    def GetModelInfo(self, request, context):
        self._authorize(context)
        return tandem_pb2.ModelInfo(
            name="fake-llama", architecture="LlamaForCausalLM", max_model_len=512, vocab_size=512, block_size=16,
            has_tokenizer=True, slo_classes=["interactive", "standard", "batch"], default_slo_class="standard",
            has_chat_template=self.chat)

    def Tokenize(self, request, context):
        self._authorize(context)
        return tandem_pb2.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    def Detokenize(self, request, context):
        self._authorize(context)
        return tandem_pb2.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))


class MetadataRecorder(grpc.ServerInterceptor):
    """Records (method, authorization header) of every call, the health service's included."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        self.calls.append((handler_call_details.method, metadata.get("authorization")))
        return continuation(handler_call_details)


class FakeServer:
    def __init__(self, credentials: grpc.ServerCredentials | None = None, host: str = "127.0.0.1"):
        self.servicer = FakeTandem(TOKEN)
        self.recorder = MetadataRecorder()
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[self.recorder])
        tandem_pb2_grpc.add_TandemServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if credentials is None:
            port = self.server.add_insecure_port(f"{host}:0")
        else:
            port = self.server.add_secure_port(f"{host}:0", credentials)
        self.address = f"{host}:{port}"
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def client(fake):
    with TandemClient(fake.address, token=TOKEN, timeout_s=30) as c:
        yield c


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Python client ---------------------------------------------------------------------------------


def test_generate_streams_a_text_prompt(client):
    responses = list(client.generate("Say hello", max_tokens=8))
    assert [list(r.token_ids) for r in responses[:-1]] == [ids for ids, _ in CANNED]
    assert "".join(r.text for r in responses) == CANNED_TEXT
    assert [t for r in responses for t in r.token_ids] == CANNED_IDS
    assert responses[0].prefill_worker == "prefill-0" and responses[0].decode_worker == "decode-0"
    last = responses[-1]
    assert last.finished and last.finish_reason == "stop"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len("Say hello"), 4)
    assert last.timings.ttft_ms == pytest.approx(5.0)
    assert not any(r.finished for r in responses[:-1])


def test_generate_token_ids_and_every_field_reach_the_server(fake, client):
    responses = list(client.generate(
        [7, 8, 9], max_tokens=2, temperature=0.0, top_p=0.9, top_k=40, min_p=0.05, seed=2**40, stop=["\n\n"],
        stop_token_ids=[3], ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.2,
        frequency_penalty=0.3, logprobs=2, slo_class="interactive", ttft_ms=250.0, tpot_ms=40.0, priority=5,
        request_id="all-fields", model="fake-llama", timeout_s=20,
    ))
    assert [t for r in responses for t in r.token_ids] == [7, 8]
    assert responses[-1].finish_reason == "length" and all(r.request_id == "all-fields" for r in responses)
    request = fake.servicer.requests[-1]
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [7, 8, 9]
    s = request.sampling
    assert s.HasField("temperature") and s.temperature == 0.0  # an explicit 0 (greedy) is sent
    assert (s.max_tokens, s.top_k, s.seed, s.logprobs) == (2, 40, 2**40, 2)
    assert (s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx(
        (0.9, 0.05, 1.1, 0.2, 0.3))
    assert list(s.stop) == ["\n\n"] and list(s.stop_token_ids) == [3] and s.ignore_eos
    assert (request.slo_class, request.priority, request.model) == ("interactive", 5, "fake-llama")
    assert (request.objectives.ttft_ms, request.objectives.tpot_ms) == pytest.approx((250.0, 40.0))
    assert 15 < fake.servicer.time_remaining[-1] <= 21  # the per-call timeout overrides the client's 30 s


def test_unset_options_stay_unset(fake, client):
    list(client.generate("defaults", stop="END"))
    request = fake.servicer.requests[-1]
    assert request.text == "defaults"
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logprobs"):
        assert not request.sampling.HasField(name), name
    assert list(request.sampling.stop) == ["END"]  # one string is one stop string, not its characters
    assert not request.HasField("objectives")
    assert (request.slo_class, request.priority, request.request_id, request.model) == ("", 0, "", "")
    assert 25 < fake.servicer.time_remaining[-1] <= 31  # the client's default timeout


def test_bad_prompts_are_refused_before_sending(client):
    with pytest.raises(TypeError):
        client.generate(b"bytes")
    with pytest.raises(TypeError):
        client.generate([1, "2"])
    with pytest.raises(ValueError, match="out of range"):
        client.generate([-1])


def test_unary_methods_and_health(fake, client):
    info = client.model_info()
    assert (info.name, info.max_model_len, info.default_slo_class) == ("fake-llama", 512, "standard")
    assert list(info.slo_classes) == ["interactive", "standard", "batch"]
    assert client.tokenize("héllo") == [ord(c) for c in "héllo"]
    assert client.detokenize([104, 105]) == "hi"
    assert client.health() == "SERVING"
    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert client.health() == "NOT_SERVING"
    finally:
        fake.health.set("", health_pb2.HealthCheckResponse.SERVING)


def test_the_token_is_sent_on_every_call(fake):
    fake.recorder.calls.clear()
    with TandemClient(fake.address, token=TOKEN) as c:
        list(c.generate("x"))
        c.model_info()
        c.tokenize("x")
        c.detokenize([120])
        c.health()
    methods = {method: auth for method, auth in fake.recorder.calls}
    assert methods == {
        "/tandem.v1.Tandem/Generate": f"Bearer {TOKEN}",
        "/tandem.v1.Tandem/GetModelInfo": f"Bearer {TOKEN}",
        "/tandem.v1.Tandem/Tokenize": f"Bearer {TOKEN}",
        "/tandem.v1.Tandem/Detokenize": f"Bearer {TOKEN}",
        "/grpc.health.v1.Health/Check": f"Bearer {TOKEN}",
    }


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_missing_or_wrong_token_is_unauthenticated(fake, token):
    with TandemClient(fake.address, token=token) as c:
        with pytest.raises(TandemError) as excinfo:
            list(c.generate("x"))
        assert excinfo.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert str(excinfo.value) == "UNAUTHENTICATED: missing or wrong bearer token"
        with pytest.raises(TandemError) as excinfo:
            c.model_info()
        assert excinfo.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert c.health() == "SERVING"  # the health service needs no token


def test_errors_become_tandem_errors(client):
    with pytest.raises(TandemError) as excinfo:
        list(client.generate("busy"))
    error = excinfo.value
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.message == "admission: queue full"
    assert str(error) == "RESOURCE_EXHAUSTED: admission: queue full"
    assert isinstance(error, Exception) and error.args == (grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: queue full")

    with pytest.raises(TandemError) as excinfo:
        list(client.generate([]))
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(excinfo.value) == "INVALID_ARGUMENT: prompt: token_ids is empty"

    received = []
    with pytest.raises(TandemError) as excinfo:
        for response in client.generate("fail midway"):
            received.append(response.text)
    assert received == ["a"]
    assert str(excinfo.value) == "UNAVAILABLE: decode worker decode-0 died"

    with pytest.raises(TandemError) as excinfo:
        list(client.generate("slow", timeout_s=0.3))
    assert excinfo.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_an_unreachable_address_is_unavailable():
    with TandemClient(f"127.0.0.1:{_closed_port()}", timeout_s=10) as c:
        with pytest.raises(TandemError) as excinfo:
            list(c.generate("x"))
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TandemError) as excinfo:
            c.health()
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE


def _assert_cancelled_on_server(fake, request_id):
    assert fake.servicer.event(f"{request_id}:callback").wait(10), "the server's RPC callback did not fire"
    assert fake.servicer.event(f"{request_id}:inactive").wait(10), "the server still sees the RPC as active"


def test_closing_the_stream_cancels_the_call(fake, client):
    stream = client.generate("endless", request_id="cancel-close")
    first = [next(stream).token_ids[0] for _ in range(3)]
    assert first == [0, 1, 2]
    stream.close()
    _assert_cancelled_on_server(fake, "cancel-close")
    assert stream.cancelled
    assert list(stream) == []  # a closed stream simply ends


def test_leaving_the_with_block_cancels_the_call(fake, client):
    with client.stream("endless", request_id="cancel-with") as stream:
        for response in stream:
            if response.token_ids[0] == 2:
                break
    _assert_cancelled_on_server(fake, "cancel-with")


def test_cancel_from_another_thread_ends_iteration(fake, client):
    stream = client.generate("endless", request_id="cancel-thread")
    seen = []
    timer = threading.Timer(0.3, stream.cancel)
    timer.start()
    try:
        for response in stream:  # no error: the cancellation came from this side
            seen.append(response.token_ids[0])
    finally:
        timer.cancel()
    assert seen and seen == list(range(len(seen)))
    _assert_cancelled_on_server(fake, "cancel-thread")


def test_tls_with_a_ca_file(tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    server = FakeServer(grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    try:
        with TandemClient(server.address, token=TOKEN, tls_ca_file=str(cert), timeout_s=30) as c:
            assert "".join(r.text for r in c.generate("tls")) == CANNED_TEXT
            assert c.health() == "SERVING"
        with TandemClient(server.address, token=TOKEN, timeout_s=30) as plain:  # plaintext to a TLS port fails
            with pytest.raises(TandemError) as excinfo:
                plain.health()
            assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


# -- tandem generate --------------------------------------------------------------------------------


class FlushRecorder(io.StringIO):
    """stdout that remembers what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        super().flush()
        self.flushed.append(self.getvalue())


def _tandem_generate(*argv: str, stdout: io.StringIO) -> int:
    """``tandem generate ARGV`` in this process, its stdout into ``stdout`` (stderr: see capsys)."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *argv])
    with contextlib.redirect_stdout(stdout):
        return args.func(args)


@pytest.fixture
def stdout():
    return FlushRecorder()


@pytest.fixture
def token_env(monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_TOKEN", TOKEN)
    return ["--token-env", "TANDEM_TEST_TOKEN"]


def test_cli_streams_text_and_flushes_each_delta(fake, stdout, token_env, capsys):
    assert _tandem_generate("--addr", fake.address, *token_env, "Say hello", stdout=stdout) == 0
    assert stdout.getvalue() == CANNED_TEXT + "\n"
    assert stdout.flushed == ["Hello", "Hello, wor", "Hello, world", "Hello, world\n"]
    assert capsys.readouterr().err == ""


def test_cli_json_prints_one_object_per_message(fake, stdout, token_env):
    assert _tandem_generate("--addr", fake.address, *token_env, "--json", "Say hello", stdout=stdout) == 0
    lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert len(lines) == len(CANNED) + 1 and len(stdout.flushed) == len(lines)
    assert [line.get("token_ids", []) for line in lines] == [ids for ids, _ in CANNED] + [[]]
    assert lines[0]["prefill_worker"] == "prefill-0"  # proto field names, not lowerCamelCase
    assert lines[-1]["finished"] is True and lines[-1]["finish_reason"] == "stop"
    assert lines[-1]["usage"]["completion_tokens"] == 4


def test_cli_sends_a_chat_to_a_chat_model_and_raw_text_on_request(fake, stdout, token_env):
    fake.servicer.chat = True
    try:
        assert _tandem_generate("--addr", fake.address, *token_env, "--system", "Be brief.", "Capital of France?",
                                stdout=stdout) == 0
        request = fake.servicer.requests[-1]
        assert request.WhichOneof("prompt") == "chat"
        assert [(m.role, m.content) for m in request.chat.messages] == [("system", "Be brief."),
                                                                       ("user", "Capital of France?")]
        assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0  # greedy by default
        assert _tandem_generate("--addr", fake.address, *token_env, "--raw", "def f(", stdout=stdout) == 0
        assert fake.servicer.requests[-1].text == "def f("
    finally:
        fake.servicer.chat = False


def test_cli_flags_reach_the_request(fake, stdout, token_env):
    rc = _tandem_generate("--addr", fake.address, *token_env, "--max-tokens", "3", "--temperature", "0", "--seed", "7",
                          "--slo-class", "interactive", "--ttft-ms", "200", "--tpot-ms", "50", "--priority", "3",
                          "--timeout", "12", "flags", stdout=stdout)
    assert rc == 0
    request = fake.servicer.requests[-1]
    assert request.text == "flags"
    s = request.sampling
    assert (s.max_tokens, s.seed) == (3, 7) and s.HasField("temperature") and s.temperature == 0.0
    assert (request.slo_class, request.priority) == ("interactive", 3)
    assert (request.objectives.ttft_ms, request.objectives.tpot_ms) == pytest.approx((200.0, 50.0))
    assert 7 < fake.servicer.time_remaining[-1] <= 13  # (the deadline as the server sees it: a little slack)


def test_cli_reads_the_prompt_from_stdin(fake, stdout, token_env, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert _tandem_generate("--addr", fake.address, *token_env, "-", stdout=stdout) == 0
    assert fake.servicer.requests[-1].text == "from stdin"
    assert stdout.getvalue() == CANNED_TEXT + "\n"


def test_cli_grpc_errors_exit_1(fake, stdout, token_env, capsys):
    assert _tandem_generate("--addr", fake.address, *token_env, "busy", stdout=stdout) == 1
    assert capsys.readouterr().err == "tandem generate: RESOURCE_EXHAUSTED: admission: queue full\n"
    assert stdout.getvalue() == ""

    assert _tandem_generate("--addr", fake.address, "no token", stdout=stdout) == 1
    assert capsys.readouterr().err == "tandem generate: UNAUTHENTICATED: missing or wrong bearer token\n"

    assert _tandem_generate("--addr", fake.address, *token_env, "fail midway", stdout=stdout) == 1
    assert capsys.readouterr().err == "tandem generate: UNAVAILABLE: decode worker decode-0 died\n"
    assert stdout.getvalue() == "a\n"  # the partial answer, its line ended

    rc = _tandem_generate("--addr", fake.address, *token_env, "--json", "--timeout", "0.3", "slow", stdout=stdout)
    assert rc == 1
    assert capsys.readouterr().err.startswith("tandem generate: DEADLINE_EXCEEDED: ")


def test_cli_unreachable_address(stdout, capsys):
    port = _closed_port()
    assert _tandem_generate("--addr", f"127.0.0.1:{port}", "x", stdout=stdout) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tandem generate: UNAVAILABLE: cannot reach a Tandem server at 127.0.0.1:{port}: "), err
    assert err.count("\n") == 1


def test_cli_usage_errors_exit_2(fake, stdout, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_NO_SUCH_TOKEN", raising=False)
    assert _tandem_generate("--addr", fake.address, "--token-env", "TANDEM_NO_SUCH_TOKEN", "x", stdout=stdout) == 2
    assert "TANDEM_NO_SUCH_TOKEN" in capsys.readouterr().err
    missing = str(tmp_path / "missing.pem")
    assert _tandem_generate("--addr", fake.address, "--tls-ca", missing, "x", stdout=stdout) == 2
    assert "missing.pem" in capsys.readouterr().err


def test_cli_as_a_module_in_a_subprocess(fake):
    """The real process: stdout is a pipe, the token comes from the environment."""
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "TANDEM_TEST_TOKEN": TOKEN, "TANDEM_ADDR": fake.address}
    result = subprocess.run([sys.executable, "-m", "tandem.cli_generate", "--token-env", "TANDEM_TEST_TOKEN", "hi"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, CANNED_TEXT + "\n", "")


# -- a Node.js client built only from the .proto ---------------------------------------------------


def test_node_client_streams_generate(fake):
    rc, lines = run_node_generate(fake.address, {"token_ids": {"ids": [5, 6, 7]}, "sampling": {"max_tokens": 2}},
                                  token=TOKEN)
    assert rc == 0, lines
    assert [t for line in lines for t in line["token_ids"]] == [5, 6]
    assert [line["text"] for line in lines] == ["<5>", "<6>", ""]
    assert lines[0]["prefill_worker"] == "prefill-0"  # proto field names kept
    assert lines[-1]["finished"] is True and lines[-1]["finish_reason"] == "length"
    assert lines[-1]["usage"] == {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 2}
    assert not any(line["finished"] for line in lines[:-1])
    request = fake.servicer.requests[-1]
    assert list(request.token_ids.ids) == [5, 6, 7] and request.sampling.max_tokens == 2

    rc, lines = run_node_generate(fake.address, {"text": "from node", "sampling": {"seed": 2**40}}, token=TOKEN)
    assert rc == 0 and "".join(line["text"] for line in lines) == CANNED_TEXT
    assert fake.servicer.requests[-1].sampling.seed == 2**40


def test_node_client_reports_error_status(fake):
    rc, lines = run_node_generate(fake.address, {"token_ids": {"ids": []}}, token=TOKEN)
    assert rc == 2
    assert lines == [{"error": {"code": 3, "details": "prompt: token_ids is empty"}}]
    rc, lines = run_node_generate(fake.address, {"text": "x"})
    assert rc == 2 and lines == [{"error": {"code": 16, "details": "missing or wrong bearer token"}}]
