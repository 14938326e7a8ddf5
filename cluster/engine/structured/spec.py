"""What a request's output must match, as it travels with its SamplingParams.

One frozen value, checked for shape here (a kind the engine knows, text within the limit) and
compiled by the engine's grammar backend; a spec the backend cannot compile is refused when the
request is added, naming the field it came from (``source``: ``response_format``, ``tools``,
``regex``, ...).

Kinds, and what ``value`` holds:

- ``json_object``: any JSON object (``value`` empty);
- ``json_schema``: a JSON schema, as JSON text;
- ``regex``: a regular expression the whole output matches;
- ``grammar``: a grammar's text (``syntax``: ``ebnf`` (GBNF) or ``lark``);
- ``choice``: a JSON list of strings, the output one of them exactly;
- ``structural_tag``: free text until a trigger opens a constrained part (tool calls under
  ``tool_choice: auto``); ``value`` is the backend-neutral JSON of ``{"triggers": [...], "structures":
  [{"begin": ..., "schema": {...}, "end": ...}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.request_limits import InvalidRequestError, quote

KINDS = ("json_object", "json_schema", "regex", "grammar", "choice", "structural_tag")
SYNTAXES = ("", "ebnf", "lark")
MAX_SPEC_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    value: str = ""
    syntax: str = ""  # grammar only: ebnf | lark
    source: str = "response_format"  # the request field it came from, named in errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.source}: unknown structured output kind {quote(self.kind)}; "
                                      f"known: {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.source}: the {self.kind} must be text, got {quote(self.value)}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"{self.source}: the {self.kind} is {len(self.value)} characters long; "
                                      f"at most {MAX_SPEC_CHARS} are allowed")
        if self.syntax not in SYNTAXES or (self.kind == "grammar") != bool(self.syntax):
            raise InvalidRequestError(f"{self.source}: a grammar's syntax must be one of ebnf, lark "
                                      f"(and only a grammar has one), got {quote(self.syntax)}")
        if self.kind != "json_object" and not self.value.strip():
            raise InvalidRequestError(f"{self.source}: the {self.kind} is empty")
