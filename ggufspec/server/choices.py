"""One choice of an answer as it comes in, piece by piece: its content (held back from where a tool
call may have begun, so a stream never shows a call's raw text), its tool calls once it ends, and
its log-probabilities in OpenAI's two shapes (chat's `content[]`, the completions API's legacy lists).

A piece is the dict the worker annotated (speculation.StepTracker): text, token, from_draft, step,
drafted, and "logprobs" (an OpenAI chat entry) when the request asked for them."""
from __future__ import annotations

import re

from .. import tools as toolkit
from .callstream import CallStream, opening_for
from .constraints import Shaping

PIECE_FIELDS = ("text", "token", "from_draft", "step", "drafted")  # what ggufspec.pieces shows
BARE_CALL = re.compile(r'\s*(```json\s*)?\{\s*"name"\s*:')  # the start of a call written as bare JSON


def token_string(raw: bytes) -> str:
    """A token's text where its bytes are UTF-8, else OpenAI's `bytes:\\xNN...` (part of a character:
    an emoji or a CJK character is often two or three tokens). Distinct tokens keep distinct strings,
    which the completions API's top_logprobs uses as keys."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprob_entry(token_bytes: bytes, logprob: float | None, top: list[tuple[bytes, float]]) -> dict:
    """OpenAI's chat log-probability entry for one token (`top`: the alternatives' bytes and logprobs)."""
    def one(raw: bytes, value: float | None) -> dict:
        return {"token": token_string(raw), "logprob": value, "bytes": list(raw)}
    return {**one(token_bytes, logprob), "top_logprobs": [one(raw, value) for raw, value in top]}


def legacy_logprobs(pieces: list[dict], offset: int = 0) -> dict:
    """The completions API's shape: tokens, token_logprobs, top_logprobs, text_offset (where each
    token's text starts in the answer, from `offset`)."""
    entries, offsets = [], []
    for piece in pieces:
        entries.append(piece["logprobs"])
        offsets.append(offset)
        offset += len(piece["text"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def shown_pieces(pieces: list[dict]) -> list[dict]:
    return [{name: p[name] for name in PIECE_FIELDS if name in p} for p in pieces]


def with_calls(finish: str, called: bool) -> str:
    """The finish reason of an answer that called tools: "tool_calls" where it ended by itself; one cut
    by max_tokens or the context keeps "length" (llama-server's), with the calls completed before the cut."""
    return "tool_calls" if called and finish != "length" else finish


class ChoiceState:
    """One choice's pieces so far, and what of them may go out as content."""

    def __init__(self, index: int, shape: Shaping, chat: bool, new_reasoning=None, stream_calls: bool = False):
        self.index, self.shape, self.chat = index, shape, chat
        self.pieces: list[dict] = []
        self.held: list[dict] = []   # pieces not yet sent: a tool call may have begun in them
        self.sent_text = ""
        self.logprob_offset = 0      # text_offset of the next legacy logprob entry
        self.finish: str | None = None
        # a reasoning model's thinking told apart (reasoning.ReasoningContent), or None: all is content
        self.new_reasoning = new_reasoning
        self.reasoning = None        # made at the first piece: the prompt (which may open <think>) is rendered by then
        self.thinking = ""           # thinking not yet sent (reasoning_content)
        # a call's name and arguments sent as written (callstream), and what of them is not yet sent
        opening = opening_for(self.shape) if stream_calls and chat else None
        self.call_stream = CallStream(*opening) if opening is not None else None
        self.call_events: list[tuple] = []

    @property
    def parsing(self) -> bool:
        return self.chat and self.shape.plan.parse

    def push(self, pieces: list[dict]) -> list[dict]:
        """The pieces that can go out as content now (their text the content's part of theirs, the
        thinking kept for `take_thinking`)."""
        self.pieces += pieces
        pieces = self.content_pieces(pieces)
        if not self.parsing:
            return pieces
        self.held += pieces
        held_text = "".join(p["text"] for p in self.held)
        start = toolkit.call_start(self.sent_text + held_text, self.shape.fmt)
        cut = len(held_text) if start is None else start - len(self.sent_text)
        released, position = [], 0
        while self.held and position + len(self.held[0]["text"]) <= cut:
            position += len(self.held[0]["text"])
            released.append(self.held.pop(0))
        self.sent_text += "".join(p["text"] for p in released)
        if self.call_stream is not None and held_text[cut:].startswith(self.call_stream.marker):
            self.call_events += self.call_stream.push(held_text[cut:])
        return released

    def take_call_events(self) -> list[tuple]:
        """("call", name) and ("arguments", delta) of the calls being written, since the last take."""
        events, self.call_events = self.call_events, []
        return events

    @property
    def streamed_calls(self) -> list[list]:
        """The calls whose name (and some arguments) went out as they were written: [name, arguments, whole]."""
        return self.call_stream.calls if self.call_stream is not None else []

    def content_pieces(self, pieces: list[dict]) -> list[dict]:
        """The pieces with the thinking taken out of their text (into `thinking`)."""
        if self.new_reasoning is None:
            return pieces
        self.reasoning = self.reasoning or self.new_reasoning()
        parted = []
        for piece in pieces:
            thought, content = self.reasoning.push(piece["text"])
            self.thinking += thought
            parted.append({**piece, "text": content})
        return parted

    def flushed(self) -> list[dict]:
        """What the thinking splitter held back, at the end: its thinking kept, its content a piece."""
        if self.new_reasoning is None:
            return []
        self.reasoning = self.reasoning or self.new_reasoning()
        thought, content = self.reasoning.flush()
        self.thinking += thought
        return [{"text": content}] if content else []

    def take_thinking(self) -> str:
        thinking, self.thinking = self.thinking, ""
        return thinking

    def end(self, cut_short: bool = False) -> tuple[list[dict], str | None, list[dict]]:
        """The choice ended (`cut_short`: by max_tokens or the context): (held pieces, their content or
        None, tool calls) for the last chunks."""
        held, self.held = self.held + self.flushed(), []
        text = "".join(p["text"] for p in held)
        if not self.parsing or not held:
            return held, text or None, []
        content, calls = toolkit.parse_calls(text, self.shape.fmt, self.shape.plan.names)
        if not calls:
            text = self.without_a_cut_call(self.sent_text + text, cut_short)[len(self.sent_text):]
            return held, text, []
        content = self.without_a_cut_call(content or "", cut_short)  # a second call, cut off
        return held, (content if content and content.strip() else None), self.tool_calls(calls)

    def without_a_cut_call(self, text: str, cut_short: bool) -> str:
        """The text without the start of a call that max_tokens cut off: the template's markup
        (`<tool_call>\n{"name": ...`) is no answer to show, nor to send back as the next turn's history."""
        if not cut_short:
            return text
        if self.shape.plan.forced:  # the answer is calls only: all of it was the call's
            return ""
        if BARE_CALL.match(text):  # llama 3's call: a JSON object naming a function, no marker
            return ""
        found = [i for marker in toolkit.CALL_MARKERS if (i := text.find(marker)) >= 0]
        found += [len(text) - k for marker in toolkit.CALL_MARKERS for k in range(1, len(marker))
                  if text.endswith(marker[:k])]  # a marker cut in two ("<tool_")
        return text[:min(found)] if found else text  # a text that merely starts with "{" stays

    def tool_calls(self, calls: list[toolkit.ToolCall]) -> list[dict]:
        return toolkit.openai_tool_calls(calls, self.shape.fmt)

    def message(self, cut_short: bool = False) -> tuple[dict, bool]:
        """The whole answer's message (chat) and whether it called tools: the content a stream of the
        same pieces shows (`push`, then `end`), so that the text before a call is the same either way."""
        fresh = ChoiceState(self.index, self.shape, self.chat, self.new_reasoning)
        pieces = fresh.content_pieces(self.pieces) + fresh.flushed()
        reasoning = {"reasoning_content": fresh.thinking} if fresh.thinking else {}
        text = "".join(p["text"] for p in pieces)
        if not self.parsing:
            return {"role": "assistant", "content": text, **reasoning}, False
        start = toolkit.call_start(text, self.shape.fmt)
        cut, sent = len(text) if start is None else start, 0
        for piece in pieces:  # what push would have released: the pieces before the cut
            if sent + len(piece["text"]) > cut:
                break
            sent += len(piece["text"])
        replay = ChoiceState(self.index, self.shape, self.chat)
        replay.sent_text, replay.held = text[:sent], [{"text": text[sent:]}]
        _, held_content, calls = replay.end(cut_short)
        content = replay.sent_text + (held_content or "")
        if calls:
            return {"role": "assistant", "content": content or None, **reasoning, "tool_calls": calls}, True
        return {"role": "assistant", "content": content, **reasoning}, False

    def logprobs(self, pieces: list[dict]) -> dict | None:
        """The pieces' log-probabilities in the API's shape, or None when not asked for."""
        if self.shape.logprobs is None:
            return None
        pieces = [p for p in pieces if "logprobs" in p]
        if self.chat:
            return {"content": [p["logprobs"] for p in pieces], "refusal": None}
        shaped = legacy_logprobs(pieces, self.logprob_offset)
        self.logprob_offset += sum(len(p["text"]) for p in pieces)
        return shaped
