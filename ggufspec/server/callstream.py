"""A tool call's name and arguments sent as the model writes them, not once the call is whole.

An agent's call that writes a file holds the whole file in its arguments: on a CPU that is a minute
of tokens, which a client shows as they come where the server streams them (llama-server does:
OpenAI's `tool_calls[].function.arguments` deltas, Anthropic's `input_json_delta`, the Responses
API's `function_call_arguments.delta`). Only where the answer cannot disagree with what was sent,
under the call grammar, which fixes the call's shape and makes the arguments a JSON object: the Hermes
format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen's and most local models') and
Mistral's newer one (`[TOOL_CALLS]name[ARGS]{...}`, `[CALL_ID]` and an id before `[ARGS]` in Small 3.2:
Devstral's, Ministral 3's).
The name goes out once it is whole, then the arguments' text as it grows, exactly as written (their
concatenation is the call's JSON; the end's parse gives the same object). Other formats (Mistral's
JSON list, Llama 3's, Qwen3's XML) are still held until the call is whole.
"""
from __future__ import annotations

import re

NAME = r"([A-Za-z0-9_.-]{1,64})"  # tools.FUNCTION_NAME
# each format's marker and the grammar's shape of a call up to its arguments' value (tc-ws and the
# converter's spaces between)
OPENINGS = {
    "hermes": ("<tool_call>", re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"' + NAME + r'"\s*,\s*"arguments"\s*:\s*')),
    "[ARGS]": ("[TOOL_CALLS]", re.compile(r"\[TOOL_CALLS\]" + NAME + r"\[ARGS\]")),
    "[CALL_ID]": ("[TOOL_CALLS]", re.compile(r"\[TOOL_CALLS\]" + NAME + r"\[CALL_ID\][a-zA-Z0-9]{9}\[ARGS\]")),
}
OPENING_MAX = 200  # characters: a marker followed by this many that do not open a call never will


def opening_for(shape) -> tuple | None:
    """(marker, opening) where a chat answer's calls can go out as they are written (see the module's
    docstring), else None."""
    plan = shape.plan
    if not (plan.parse and plan.grammar):
        return None
    return OPENINGS.get("hermes" if shape.fmt.name == "hermes" else shape.fmt.named if shape.fmt.name == "mistral" else "")


def streams_calls(shape) -> bool:
    return opening_for(shape) is not None


class CallStream:
    """Fed the answer's text from its first call's marker on (growing), says what is new: a call
    begun (its name), more of its arguments."""

    def __init__(self, marker: str = "<tool_call>", opening: re.Pattern = OPENINGS["hermes"][1]):
        self.marker, self.opening = marker, opening
        self.text = ""
        self.position = 0        # how far the text has been read
        self.calls: list[list] = []  # [name, arguments so far, whole]
        self.gone_wrong = False  # not the grammar's shape (a grammar-free answer): nothing more streamed
        self._depth, self._in_string, self._escaped = 0, False, False

    @property
    def open(self) -> bool:
        return bool(self.calls) and not self.calls[-1][2]

    def push(self, text: str) -> list[tuple]:
        """("call", name) and ("arguments", delta) events since the last push; `text` starts at the
        first call's marker and holds what it held before."""
        self.text, events = text, []
        while not self.gone_wrong:
            if self.open:
                delta = self._read_arguments()
                if delta:
                    self.calls[-1][1] += delta
                    events.append(("arguments", delta))
                if self.open:  # the rest is still to come
                    break
            elif not self._read_opening(events):
                break
        return events

    def _read_opening(self, events: list) -> bool:
        """The next call's opening, where it is all here (False: wait for more, or it went wrong)."""
        start = self.text.find(self.marker, self.position)
        if start < 0:
            return False
        found = self.opening.match(self.text, start)
        value = found.end() if found else -1
        if found is None or value >= len(self.text):
            self.gone_wrong = found is None and len(self.text) - start > OPENING_MAX
            return False
        if self.text[value] != "{":  # the grammar makes the arguments an object
            self.gone_wrong = True
            return False
        self.calls.append([found[1], "", False])
        self.position, self._depth, self._in_string, self._escaped = value, 0, False, False
        events.append(("call", found[1]))
        return True

    def _read_arguments(self) -> str:
        """The open call's arguments read on to the end of the text or of their JSON object."""
        text, start = self.text, self.position
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        end = len(text)
        for i in range(start, len(text)):
            char = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    self.calls[-1][2] = True
                    break
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        self.position = end
        return text[start:end]
