"""The request fields that ask for structured output, read the same way by every way in (the
OpenAI HTTP API, ``tandem run`` input lines; the gRPC API has the same choices as a ``oneof``):

- ``response_format`` (OpenAI's): ``{"type": "text"}`` (free text, as without it),
  ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (``schema`` required; the output is always held to it, ``strict``
  or not);
- ``regex``: a regular expression the whole output matches;
- ``grammar``: a grammar's text, GBNF (llama.cpp's EBNF) unless ``grammar_syntax`` is ``"lark"``;
- ``choice``: a list of strings, the output exactly one of them.

At most one of them per request. Each error names its field; whether the schema, regex or
grammar compiles is :func:`~cluster.engine.structured.grammars.check`'s to say.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from cluster.engine.request_limits import InvalidRequestError, quote
from cluster.engine.structured.spec import StructuredOutput

FIELDS = ("response_format", "regex", "grammar", "grammar_syntax", "choice")
_ASKING = ("response_format", "regex", "grammar", "choice")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def structured_output(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The spec ``body``'s fields ask for, or None (free text)."""
    asked = [name for name in _ASKING if name in body and body[name] is not None and not _is_text(body, name)]
    if len(asked) > 1:
        raise InvalidRequestError(f"{asked[1]}: give at most one of response_format, regex, grammar and choice "
                                  f"(this request also has {asked[0]})")
    if body.get("grammar_syntax") is not None and asked != ["grammar"]:
        raise InvalidRequestError("grammar_syntax: goes with grammar")
    if not asked:
        return None
    name = asked[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(f"choice: must be a non-empty list of non-empty strings, got {quote(value)}")
        return StructuredOutput("choice", json.dumps(value), source="choice")
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name}: must be a string, got {quote(value)}")
    if name == "regex":
        return StructuredOutput("regex", value, source="regex")
    syntax = body.get("grammar_syntax") or "ebnf"
    if syntax not in ("ebnf", "lark"):
        raise InvalidRequestError(f"grammar_syntax: must be \"ebnf\" (GBNF) or \"lark\", got {quote(syntax)}")
    return StructuredOutput("grammar", value, syntax=syntax, source="grammar")


def _is_text(body: Mapping[str, Any], name: str) -> bool:
    """``response_format: {"type": "text"}``: free text, as if it were not given."""
    value = body[name]
    return name == "response_format" and isinstance(value, Mapping) and value.get("type") == "text" and len(value) == 1


def _response_format(value: Any) -> StructuredOutput:
    if not isinstance(value, Mapping) or value.get("type") not in ("json_object", "json_schema"):
        raise InvalidRequestError('response_format: must be {"type": "text"}, {"type": "json_object"} or '
                                  f'{{"type": "json_schema", "json_schema": {{...}}}}, got {quote(value)}')
    kind = value["type"]
    extra = sorted(set(value) - {"type", kind} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise InvalidRequestError(f"response_format: unknown key {quote(extra[0])} for type {kind}")
    if kind == "json_object":
        return StructuredOutput("json_object", source="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidRequestError('response_format: json_schema must be an object {"name", "schema", "strict"}')
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise InvalidRequestError(f"response_format: unknown key json_schema.{unknown[0]}")
    for key, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise InvalidRequestError(f"response_format: json_schema.{key} must be a {kinds.__name__}, "
                                      f"got {quote(spec[key])}")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"response_format: json_schema.schema must be a JSON schema object, "
                                  f"got {quote(schema)}")
    return StructuredOutput("json_schema", json.dumps(schema), source="response_format")
