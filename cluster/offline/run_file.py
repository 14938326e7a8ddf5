"""``tandem run``: a JSONL file of requests in, a JSONL file of results out, in input order.

Sampling fields sit beside the prompt, structured output's as in the OpenAI API
(``response_format``, ``regex``, ``grammar``, ``grammar_syntax``, ``choice``:
``cluster/engine/structured/fields.py``).

A bad line (malformed JSON, an unknown field, a prompt longer than the context) gets an
``error`` in its output line; every other line still runs. Each output line echoes its input
line's ``id`` as it was given: an integer stays an integer. Ids are compared as text, so ``1``
and ``"1"`` are the same id (the second is a duplicate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, TextIO

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.offline.llm import LLM
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.request_limits import MAX_REQUEST_ID_CHARS, quote
from cluster.engine.structured.fields import FIELDS as STRUCTURED_FIELDS
from cluster.engine.structured.fields import structured_output

REQUEST_FIELDS = frozenset({"id", "prompt", "prompt_token_ids", "messages", "tools", "priority", "slo_class"})
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


@dataclass
class InputLine:
    line_number: int
    request_id: str | None  # the engine's id: the line's id as text
    error: str | None = None
    given_id: str | int | None = None  # the line's id as the JSON gave it, echoed in the result


def _parse(line_number: int, raw: str) -> tuple[InputLine, dict[str, Any] | None]:
    try:
        raw.encode("utf-8")  # the CLI reads with surrogateescape: undecodable bytes show up here
    except UnicodeEncodeError as exc:
        return InputLine(line_number, None, f"line {line_number}: malformed JSON: not valid UTF-8 at "
                                            f"character {exc.start + 1}"), None
    try:
        item = json.loads(raw.rstrip("\r\n"))  # so that a column past the end is the line's end
    except json.JSONDecodeError as exc:
        return InputLine(line_number, None, f"line {line_number}: malformed JSON: {exc.msg} at column {exc.pos + 1}"), None
    except ValueError:  # an integer of more digits than Python converts
        return InputLine(line_number, None, f"line {line_number}: malformed JSON: a number too long to read"), None
    if not isinstance(item, dict):
        return InputLine(line_number, None, f"line {line_number}: expected a JSON object"), None
    request_id = item.get("id")
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        return InputLine(line_number, None, f"line {line_number}: 'id' must be a string or integer"), None
    if len(str(request_id)) > MAX_REQUEST_ID_CHARS:
        return InputLine(line_number, None, f"line {line_number}: 'id' is {len(str(request_id))} characters long; "
                                            f"at most {MAX_REQUEST_ID_CHARS} are allowed"), None
    return InputLine(line_number, str(request_id), given_id=request_id), item


def _submit(engine: LLMEngine, entry: InputLine, item: dict[str, Any]) -> None:
    sampling = {k: v for k, v in item.items() if k not in REQUEST_FIELDS and k not in STRUCTURED_FIELDS}
    if "structured" in sampling:
        raise InvalidRequestError("unknown sampling field(s): structured (give response_format, regex, grammar or "
                                  "choice)")
    structured = structured_output(item)
    params = SamplingParams.from_mapping({**sampling, "structured": structured} if structured else sampling)
    given = [name for name in PROMPT_FIELDS if name in item]
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of 'prompt' (text), 'prompt_token_ids' (list of ints) or "
                                  "'messages' (list of {\"role\", \"content\"} objects)")
    if "tools" in item and given != ["messages"]:
        raise InvalidRequestError("'tools' goes with 'messages'")
    has_text, has_ids = given == ["prompt"], given == ["prompt_token_ids"]
    prompt = item[given[0]]
    if given == ["messages"]:
        _check_unicode(item["messages"], "messages")
        prompt = ChatPrompt(item["messages"], tools=item.get("tools"))
    if has_text and not isinstance(prompt, str):
        raise InvalidRequestError("'prompt' must be a string")
    if has_text:
        _check_unicode(prompt, "prompt")
    if has_ids and not isinstance(prompt, list):
        raise InvalidRequestError("'prompt_token_ids' must be a list of integers")
    priority = item.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("'priority' must be an integer")
    if "slo_class" not in item:
        engine.add_request(entry.request_id, prompt, params, priority=priority)
    elif not getattr(engine, "routes_by_slo", False):
        raise InvalidRequestError("'slo_class' needs the router: run with --disaggregated")
    else:
        engine.add_request(entry.request_id, prompt, params, priority=priority, slo_class=item["slo_class"])


def _check_unicode(value: Any, field: str) -> None:
    """Text that JSON escapes let through but UTF-8 cannot encode (a lone surrogate)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f" at character {exc.start + 1}" if isinstance(value, str) else ""
        raise InvalidRequestError(f"'{field}' is not valid Unicode: lone surrogate{where}")


def _result(entry: InputLine, output: RequestOutput | None) -> dict[str, Any]:
    if output is None:
        return {
            "id": entry.given_id, "token_ids": [], "text": "", "finish_reason": "error",
            "usage": {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}, "error": entry.error,
        }
    result = {
        "id": entry.given_id,
        "token_ids": output.token_ids,
        "text": output.text,
        "finish_reason": output.finish_reason,
        "usage": {"prompt_tokens": output.usage.prompt_tokens, "cached_tokens": output.usage.cached_tokens,
                  "completion_tokens": output.usage.completion_tokens},
        "error": output.error,
    }
    if output.logprobs is not None:
        result["logprobs"] = output.logprobs
        result["top_logprobs"] = [[[tid, lp] for tid, lp in row] for row in output.top_logprobs or []]
    return result


def run_file(llm: LLM, lines: Iterable[str], out: TextIO, progress: bool = True) -> dict[str, int]:
    """Runs every request of a JSONL stream; returns counts of results by finish reason."""
    entries: list[InputLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        entry, item = _parse(number, raw)
        entries.append(entry)
        if item is None:
            continue
        if entry.request_id in seen:
            entry.error = f"line {number}: duplicate id {quote(entry.given_id)}"
            continue
        seen.add(entry.request_id)  # a later line with this id is a duplicate even if this one fails
        try:
            _submit(llm.engine, entry, item)
        except InvalidRequestError as exc:
            entry.error = f"line {number}: {exc}"
    outputs = llm.run_until_done([e.request_id for e in entries if e.error is None], progress=progress)
    by_id = {o.request_id: o for o in outputs}
    counts: dict[str, int] = {}
    for entry in entries:
        result = _result(entry, by_id.get(entry.request_id) if entry.error is None else None)
        counts[result["finish_reason"]] = counts.get(result["finish_reason"], 0) + 1
        out.write(json.dumps(result) + "\n")
    return counts
