"""A spec as the grammar backend's text, checked without a tokenizer.

Each kind becomes an llguidance grammar (``backend.py`` says why llguidance): JSON schemas,
regexes and Lark grammars through llguidance's own compilers, GBNF through its GBNF-to-Lark
converter, a choice as a Lark alternation of its strings, a structural tag as llguidance's
lazy-trigger grammar. :func:`check` also validates the result (no tokenizer needed, no torch
imported), so an ingress refuses a bad schema, regex or grammar before it routes the request,
with the library's reason; the engine compiles the same text against its tokenizer.

JSON is generated with fixed separators (``", "`` between items, ``": "`` after keys: what
``json.dumps`` writes) and no other whitespace: a model cannot pad its output with whitespace
for ever, so an output whose strings and arrays are bounded always completes.
"""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher, StructTag
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from cluster.engine.request_limits import InvalidRequestError, clip
from cluster.engine.structured.spec import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_REASON_CHARS = 200  # of the library's reason, in one error line
_WHAT = {"json_object": "the JSON object grammar", "json_schema": "the JSON schema", "regex": "the regex",
         "grammar": "the grammar", "choice": "the choice", "structural_tag": "the structural tag"}


def check(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec``; InvalidRequestError naming ``spec.source`` and the
    library's reason when it does not compile. Cached by spec (not by the field it came from)."""
    grammar, reason = _compiled(spec.kind, spec.value, spec.syntax)
    if reason is not None:
        raise InvalidRequestError(f"{spec.source}: {_WHAT[spec.kind]} is not valid: {reason}")
    return grammar


def one_line(text: str) -> str:
    """A library's (often multi-line) message as one clipped line."""
    return clip(" ".join(str(text).split()), MAX_REASON_CHARS)


@lru_cache(maxsize=512)
def _compiled(kind: str, value: str, syntax: str) -> tuple[str | None, str | None]:
    """(grammar, None), or (None, why it does not compile)."""
    try:
        grammar = _grammar_text(kind, value, syntax)
    except (ValueError, GbnfToLarkError) as exc:
        return None, one_line(exc)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if failed:
        return None, one_line(messages[0] if messages else "rejected by the grammar compiler")
    return grammar, None


def _grammar_text(kind: str, value: str, syntax: str) -> str:
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(_json(value, "schema", dict), overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(gbnf_to_lark(value) if syntax == "ebnf" else value)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in _choices(value)))
    if kind == "structural_tag":
        return StructTag.to_grammar(_struct_tags(value), assume_special=False)
    raise ValueError(f"unknown kind {kind!r}")


def _json(value: str, what: str, kind: type):
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the {what} is not valid JSON ({exc})") from None
    if not isinstance(parsed, kind):
        raise ValueError(f"the {what} must be a JSON {'object' if kind is dict else 'list'}")
    return parsed


def _choices(value: str) -> list[str]:
    choices = _json(value, "choice", list)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("the choice must be a non-empty list of non-empty strings")
    return choices


def _struct_tags(value: str) -> list[StructTag]:
    """``{"triggers": [...], "structures": [{"begin", "schema", "end"}]}`` (``spec.py``) as
    llguidance's tags: each structure's trigger is the longest trigger its ``begin`` starts with."""
    tag = _json(value, "structural tag", dict)
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if set(tag) != {"triggers", "structures"}:
        raise ValueError('the structural tag must have exactly the keys "triggers" and "structures"')
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list")
    tags = []
    for index, structure in enumerate(structures):
        if (not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"}
                or not isinstance(structure["begin"], str) or not isinstance(structure["end"], str)
                or not isinstance(structure["schema"], dict)):
            raise ValueError(f'structures[{index}] must be {{"begin": text, "schema": object, "end": text}}')
        begin = structure["begin"]
        opening = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if opening is None:
            raise ValueError(f"structures[{index}].begin must start with one of the triggers")
        schema = {**structure["schema"], "x-guidance": JSON_OPTIONS}
        tags.append(StructTag(trigger=opening, begin=begin, grammar=schema, end=structure["end"]))
    return tags
