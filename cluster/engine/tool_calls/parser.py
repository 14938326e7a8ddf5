"""Reads a model's output text, delta by delta, as content and tool calls in its format.

``ToolCallParser.feed(text)`` returns events: ``ContentDelta`` for text meant for the user,
``CallOpened`` once a call's function name is known, ``ArgumentsDelta`` as its arguments' JSON
arrives (the raw text the model wrote, so the pieces join to exactly the final arguments), and
``CallClosed``. ``finish()`` flushes what was held back. The same parser answers a whole text
(``parse``), so streamed and whole responses never disagree.

Text that might be the start of a trigger (``<tool`` at the end of a delta) is held until the
next delta says whether it is, and trailing whitespace until what follows it is known:
whitespace around calls is not content, so a response of calls only has no content. Text that opens like a call but does not continue as
one (``<tool_call>`` then prose) is given back as content.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field

from cluster.engine.tool_calls.formats import ToolCallFormat

ARGUMENT_KEYS = ("arguments", "parameters")
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallClosed:
    index: int
    arguments: str  # the whole arguments' JSON text
    complete: bool = True  # false: the output ended inside the call


Event = ContentDelta | CallOpened | ArgumentsDelta | CallClosed


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def call_id(fmt: ToolCallFormat) -> str:
    if fmt.id_length:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(fmt.id_length))
    return "call_" + uuid.uuid4().hex[:24]


class _CallScanner:
    """One call's JSON object, read character by character: its top-level keys and the raw
    text of their values, so that the arguments can be streamed as they are written."""

    def __init__(self):
        self.raw = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.phase = "start"  # start, key, colon, value, in_value, after
        self.key_start = 0
        self.key: str | None = None
        self.value_start = 0
        self.value_kind = ""  # string, container or scalar
        self.values: dict[str, str] = {}  # complete top-level values, raw
        self.done = False
        self.error = False

    def feed(self, text: str) -> int:
        """Reads characters until the object closes; returns how many it took."""
        for offset, char in enumerate(text):
            self._step(char)
            if self.done or self.error:
                return offset + 1
        return len(text)

    def partial(self, key: str) -> tuple[str, bool] | None:
        """The raw text of ``key``'s value so far and whether it is complete; None if not begun."""
        if key in self.values:
            return self.values[key], True
        if self.phase == "in_value" and self.key == key:
            return self.raw[self.value_start:], False
        return None

    def _step(self, char: str) -> None:
        self.raw += char
        i = len(self.raw) - 1
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                if self.phase == "key":
                    try:
                        self.key = json.loads(self.raw[self.key_start:i + 1])
                    except ValueError:
                        self.error = True
                    self.phase = "colon"
                elif self.phase == "in_value" and self.depth == 1:
                    self._end_value(i + 1)
            return
        if self.phase == "in_value":
            if self.value_kind == "scalar":
                if char in ",}" or char.isspace():
                    self._end_value(i)
                    self._after(char)
                return
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._end_value(i + 1)
            return
        if char.isspace():
            return
        if self.phase == "start":
            if char == "{":
                self.depth, self.phase = 1, "key"
            else:
                self.error = True
        elif self.phase == "key":
            if char == '"':
                self.key_start, self.in_string = i, True
            elif char == "}" and not self.values:
                self.done = True
            else:
                self.error = True
        elif self.phase == "colon":
            if char == ":":
                self.phase = "value"
            else:
                self.error = True
        elif self.phase == "value":
            self.phase, self.value_start = "in_value", i
            if char == '"':
                self.value_kind, self.in_string = "string", True
            elif char in "{[":
                self.value_kind = "container"
                self.depth += 1
            else:
                self.value_kind = "scalar"
        elif self.phase == "after":
            self._after(char)

    def _end_value(self, end: int) -> None:
        self.values[self.key] = self.raw[self.value_start:end]
        self.phase = "after"

    def _after(self, char: str) -> None:
        if char.isspace():
            return
        if char == ",":
            self.phase = "key"
        elif char == "}":
            self.depth, self.done = 0, True
        else:
            self.error = True


class ToolCallParser:
    def __init__(self, fmt: ToolCallFormat):
        self.format = fmt
        self.calls: list[ParsedCall] = []
        self.content = ""
        self._pending = ""  # text not yet read
        self._mode = "text"  # text, open, item, call, after
        self._region = ""  # the region's text since its trigger or its last call, given back if no call follows
        self._scanner: _CallScanner | None = None
        self._opened = False  # the current call's CallOpened was sent
        self._sent = 0  # characters of the current call's arguments sent
        self._held_space = ""  # whitespace content waiting to see what follows it
        self._events: list[Event] = []

    # -- the interface ----------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._mode == "call":
            self._end_call(complete=False)
        elif self._mode in ("open", "item"):
            self._give_back()
        if self._mode == "text" and self._pending:
            self._content(self._pending)
        self._pending = ""
        if self._held_space and not self.calls:
            self._emit(ContentDelta(self._held_space))
            self.content += self._held_space
        self._held_space = ""
        return self._take()

    def parse(self, text: str) -> ParsedOutput:
        """The whole of a finished output."""
        self.feed(text)
        self.finish()
        return ParsedOutput(self.content, self.calls)

    # -- the machine ------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._pending:
            before = (self._mode, len(self._pending))
            step = getattr(self, f"_{self._mode}")
            if not step(final) or (self._mode, len(self._pending)) == before:
                return

    def _text(self, final: bool) -> bool:
        found = [(self._pending.find(t.text), t) for t in self.format.triggers]
        found = [(at, t) for at, t in found if at >= 0]
        if found:
            at, trigger = min(found, key=lambda pair: pair[0])
            self._content(self._pending[:at])
            self._region = ""
            if trigger.kept:
                self._pending = self._pending[at:]
            else:
                self._region = trigger.text
                self._pending = self._pending[at + len(trigger.text):]
            self._mode = "open"
            return True
        keep = 0 if final else self._partial_trigger()
        self._content(self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _partial_trigger(self) -> int:
        """How many characters at the end of the pending text could begin a trigger."""
        longest = 0
        for trigger in self.format.triggers:
            for n in range(min(len(trigger.text) - 1, len(self._pending)), longest, -1):
                if trigger.text.startswith(self._pending[-n:]):
                    longest = n
                    break
        return longest

    def _open(self, final: bool) -> bool:
        char = self._skip_space()
        if char is None:
            return False
        if self.format.array:
            if char != "[":
                self._give_back()
                return True
            self._consume(1)
            self._mode = "item"
            return True
        if char != "{":
            self._give_back()
            return True
        self._start_call()
        return True

    def _item(self, final: bool) -> bool:
        char = self._skip_space()
        if char is None:
            return False
        if char == "{":
            self._start_call()
        elif char == "]":
            self._consume(1)
            self._mode = "text"
        else:
            self._give_back()
        return True

    def _call(self, final: bool) -> bool:
        scanner = self._scanner
        taken = scanner.feed(self._pending)
        self._region += self._pending[:taken]
        self._pending = self._pending[taken:]
        if scanner.error:
            if self._opened:  # the call as far as it went; what follows is text
                self._end_call(complete=False)
                self._mode = "text"
            else:
                self._give_back()
            return True
        self._advance_call()
        if scanner.done and self._end_call(complete=True):
            self._mode = "after"
        return True

    def _after(self, final: bool) -> bool:
        char = self._skip_space()
        if char is None:
            return False
        fmt = self.format
        if fmt.array:
            if char in ",]":
                self._consume(1)
            self._mode = "item" if char == "," else "text"
            return True
        if fmt.closer:
            if self._pending.startswith(fmt.closer):
                self._consume(len(fmt.closer))
                self._mode = "text"
                return True
            if fmt.closer.startswith(self._pending):
                if not final:
                    return False  # maybe the closer, still arriving
                self._consume(len(self._pending))  # the closer cut short (max_tokens): syntax, not content
                self._mode = "text"
                return True
        if fmt.separator and char == fmt.separator:
            self._consume(1)
            self._mode = "open"
            return True
        self._mode = "text"
        return True

    # -- helpers ------------------------------------------------------------------------------

    def _skip_space(self) -> str | None:
        """The first character that is not whitespace, consuming the whitespace; None when
        there is only whitespace so far."""
        stripped = self._pending.lstrip()
        self._consume(len(self._pending) - len(stripped))
        return stripped[0] if stripped else None

    def _consume(self, n: int) -> None:
        self._region += self._pending[:n]
        self._pending = self._pending[n:]

    def _give_back(self) -> None:
        """The region opened like a call but does not go on as one: its text is content."""
        self._mode = "text"
        self._scanner = None
        self._content(self._region)
        self._region = ""

    def _start_call(self) -> None:
        self._scanner = _CallScanner()
        self._opened, self._sent = False, 0
        self._mode = "call"

    def _advance_call(self) -> None:
        scanner = self._scanner
        if not self._opened:
            name = scanner.values.get("name")
            if name is None:
                return
            try:
                name = json.loads(name)
            except ValueError:
                scanner.error = True
                return
            self._held_space = ""  # whitespace before a call is not content
            call = ParsedCall(call_id(self.format), name if isinstance(name, str) else json.dumps(name))
            self.calls.append(call)
            self._opened = True
            self._emit(CallOpened(len(self.calls) - 1, call.id, call.name))
        arguments = self._arguments(final=False)
        if arguments is not None and len(arguments) > self._sent:
            self._emit(ArgumentsDelta(len(self.calls) - 1, arguments[self._sent:]))
            self._sent = len(arguments)

    def _arguments(self, final: bool) -> str | None:
        """The arguments' text so far (whole when ``final``). A value written as a JSON string
        (``"arguments": "{...}"``) is its decoded text, known only once it is complete."""
        for key in ARGUMENT_KEYS:
            found = self._scanner.partial(key)
            if found is None:
                continue
            text, complete = found
            if text.startswith('"'):
                if not complete:
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    return text
            return text
        return "{}" if final else None

    def _end_call(self, complete: bool) -> bool:
        """Closes the current call; False (and its text given back as content) when it never
        named its function."""
        if not self._opened:
            self._advance_call()
        if not self._opened:
            self._give_back()
            return False
        index = len(self.calls) - 1
        arguments = self._arguments(final=complete) or ""
        if len(arguments) > self._sent:
            self._emit(ArgumentsDelta(index, arguments[self._sent:]))
        self.calls[index].arguments, self.calls[index].complete = arguments, complete
        self._emit(CallClosed(index, arguments, complete))
        self._scanner = None
        self._opened = False
        self._region = ""
        return True

    def _content(self, text: str) -> None:
        """Content, but its trailing whitespace waits: before a call (or at the end of a
        response with calls) it is not content, whatever the deltas' boundaries."""
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            self.content += body
            self._emit(ContentDelta(body))

    def _emit(self, event: Event) -> None:
        if isinstance(event, ArgumentsDelta):
            call = self.calls[event.index]
            call.arguments += event.text
        self._events.append(event)

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def parse(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    return ToolCallParser(fmt).parse(text)
