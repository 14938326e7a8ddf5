"""``tandem generate``: one prompt to a running Tandem cluster over gRPC, the answer streamed to stdout.

    tandem generate --addr 127.0.0.1:50051 --max-tokens 32 "Once upon a time"
    echo "Once upon a time" | tandem generate --json -

Exit status: 0 when the answer is complete, 1 on a gRPC error (printed to stderr as
``tandem generate: <CODE>: <message>``), 2 on a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

from tandem.client import DEFAULT_ADDRESS, TandemClient, TandemError

PROG = "tandem generate"


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``generate`` subcommand to ``subparsers`` (from ``parser.add_subparsers()``); the
    parsed namespace's ``func`` runs it and returns the exit status."""
    parser = subparsers.add_parser(
        "generate", help="send one prompt to a running Tandem cluster and stream the answer",
        description="Sends one prompt to a Tandem cluster's gRPC endpoint and streams the answer to stdout.",
    )
    parser.add_argument("prompt", metavar="PROMPT",
                        help="the prompt text, or '-' to read it from stdin (without its final newline)")
    parser.add_argument("--addr", metavar="HOST:PORT",
                        help=f"the cluster's gRPC address (default: $TANDEM_ADDR or {DEFAULT_ADDRESS})")
    parser.add_argument("--token-env", metavar="NAME",
                        help="name of the environment variable holding the bearer token")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA certificates: connect with TLS verified by them")
    parser.add_argument("--raw", action="store_true",
                        help="send PROMPT as plain text to continue, even where the model has a chat template "
                             "(otherwise it is one user message of a chat)")
    parser.add_argument("--system", metavar="TEXT", help="a system message before PROMPT (chat models)")
    parser.add_argument("--json", action="store_true",
                        help="print each response message as one JSON object per line instead of the text")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="most tokens to generate (server default: 16)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="sampling temperature (default: 0, greedy: the model's most likely answer)")
    parser.add_argument("--seed", type=int, metavar="S", help="per-request seed")
    parser.add_argument("--slo-class", default="", metavar="C",
                        help="SLO class, e.g. interactive, standard or batch (default: the cluster's)")
    parser.add_argument("--ttft-ms", type=float, metavar="X", help="time-to-first-token objective in ms")
    parser.add_argument("--tpot-ms", type=float, metavar="Y", help="time-per-output-token objective in ms")
    parser.add_argument("--priority", type=int, default=0, metavar="P", help="higher is scheduled first (default: 0)")
    parser.add_argument("--timeout", type=float, metavar="S", help="deadline of the call in seconds (default: none)")
    parser.set_defaults(func=run_generate)
    return parser


def _read_prompt(prompt: str) -> str:
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def _is_unreachable(error: TandemError) -> bool:
    import grpc

    if error.code != grpc.StatusCode.UNAVAILABLE:
        return False
    message = error.message.lower()
    return any(s in message for s in ("failed to connect", "connection refused", "dns resolution failed",
                                      "name resolution", "connect failed", "no route to host"))


def run_generate(args: argparse.Namespace) -> int:
    """Runs ``tandem generate`` for parsed arguments; returns the exit status."""
    address = args.addr or os.environ.get("TANDEM_ADDR") or DEFAULT_ADDRESS
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            print(f"{PROG}: environment variable {args.token_env} (--token-env) is not set or empty", file=sys.stderr)
            return 2
    try:
        prompt = _read_prompt(args.prompt)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{PROG}: cannot read the prompt from stdin: {exc}", file=sys.stderr)
        return 2
    try:
        client = TandemClient(address, token=token, tls_ca_file=args.tls_ca, timeout_s=args.timeout)
    except OSError as exc:
        print(f"{PROG}: cannot read --tls-ca {args.tls_ca}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    with client:
        if not args.raw:
            try:
                chat = client.model_info().has_chat_template
            except TandemError as exc:
                return _failed(exc, address)
            if chat:
                prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                         [{"role": "user", "content": prompt}]
        try:
            stream = client.generate(
                prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                slo_class=args.slo_class, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, priority=args.priority,
            )
        except (TypeError, ValueError) as exc:  # out-of-range values the request cannot hold
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        return _stream(stream, address, as_json=args.json)


def _failed(exc: TandemError, address: str) -> int:
    message = exc.message
    if _is_unreachable(exc):
        message = f"cannot reach a Tandem server at {address}: {message}"
    print(f"{PROG}: {exc.code.name}: {message}", file=sys.stderr)
    return 1


def _stream(stream, address: str, *, as_json: bool) -> int:
    from google.protobuf.json_format import MessageToDict

    out = sys.stdout
    wrote_text = False
    with stream:
        try:
            for response in stream:
                if as_json:
                    out.write(json.dumps(MessageToDict(response, preserving_proto_field_name=True),
                                         ensure_ascii=False) + "\n")
                elif response.text:
                    out.write(response.text)
                    wrote_text = True
                else:
                    continue
                out.flush()
            if not as_json:
                out.write("\n")
                out.flush()
            return 0
        except TandemError as exc:
            if wrote_text:
                out.write("\n")
                out.flush()
            return _failed(exc, address)
        except KeyboardInterrupt:
            stream.cancel()
            print(f"\n{PROG}: interrupted; the request was cancelled", file=sys.stderr)
            return 130
        except BrokenPipeError:  # the reader went away (e.g. `| head`): cancel the call and stop quietly
            stream.cancel()
            try:  # so that the interpreter's final flush of stdout does not fail again
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):
                pass
            return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m tandem.cli_generate ARGS``: the same as ``tandem generate ARGS``."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
