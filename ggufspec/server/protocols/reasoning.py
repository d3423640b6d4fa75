"""A reasoning model's thinking told apart from its answer: the text between `<think>` and `</think>`
(Qwen3, DeepSeek-R1 and the models trained on their format). Anthropic's `thinking` blocks and the
Responses API's `reasoning` items carry it; the answer is the rest. A template that knows no
`</think>` gets its answer as it is."""
from __future__ import annotations

from dataclasses import dataclass

from ... import load
from ...errors import GgufspecError
from ...thinking import CLOSE, OPEN  # the engine's tags: the block it budgets is the one split off here
from .core import Text


@dataclass(frozen=True)
class Thinking:
    text: str


def template_thinking(decoder) -> tuple[bool, bool]:
    """(whether the target's chat template knows a thinking block, whether its assistant turn opens
    one itself, so that the answer starts inside it: DeepSeek-R1's templates do)."""
    if CLOSE not in load.chat_template(decoder.target_llm).text:
        return False, False
    try:
        prompt = load.render_chat(decoder.target_llm, [{"role": "user", "content": "x"}])
    except GgufspecError:
        return True, False
    return True, prompt.rstrip().endswith(OPEN)


def splitter_for(serving, job=None) -> ThinkingSplitter | None:
    """A splitter for an answer of the served model, when its template knows a thinking block (and
    --skip-chat-parsing does not leave it in the text); the answer starts inside it where the job's
    rendered prompt opened it (its variables may say not to)."""
    knows, opens = serving.thinking
    if not knows or serving.chat.skip_chat_parsing:
        return None
    return ThinkingSplitter(job.opens_thinking if job is not None else opens)


def reasoning_content_for(serving, body, job):
    """For OpenAI chat's answer, a maker of each choice's ReasoningContent, or None where the thinking
    stays in `content`: llama-server's reasoning_format (the request's, else --reasoning-format) "none",
    --skip-chat-parsing, or a template that knows no thinking block."""
    form = body.reasoning_format or serving.reasoning_format
    if form == "none" or not serving.thinking[0] or serving.chat.skip_chat_parsing:
        return None
    return lambda: ReasoningContent(job.opens_thinking, keep_in_content=form == "deepseek-legacy")


class ReasoningContent:
    """A choice's text as it comes, split into (reasoning_content, content), as llama-server's
    reasoning_format deepseek does; deepseek-legacy keeps the whole text in content as well."""

    def __init__(self, opened: bool, keep_in_content: bool = False):
        self.splitter, self.keep_in_content = ThinkingSplitter(opened), keep_in_content

    def push(self, text: str) -> tuple[str, str]:
        return self._parted(self.splitter.push(text), text)

    def flush(self) -> tuple[str, str]:
        return self._parted(self.splitter.flush(), "")

    def _parted(self, events: list, text: str) -> tuple[str, str]:
        thinking = "".join(e.text for e in events if isinstance(e, Thinking))
        if self.keep_in_content:
            return thinking, text
        return thinking, "".join(e.text for e in events if not isinstance(e, Thinking))


def trailing_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` begin `marker` (held back: the marker may be coming)."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class ThinkingSplitter:
    """Text events in, Thinking and Text events out, as the text comes (a marker split between two
    pieces is held back until it is whole)."""

    def __init__(self, opened: bool):
        self.state = "thinking" if opened else "start"   # start: the answer may still open with <think>
        self.pending = ""
        self.strip = False   # the answer after </think>: its leading blank lines go

    def push(self, text: str) -> list:
        self.pending += text
        events = []
        while True:
            if self.state == "start":
                begun = self.pending.lstrip()
                if begun.startswith(OPEN):
                    self.pending, self.state = begun[len(OPEN):], "thinking"
                    continue
                if OPEN.startswith(begun):  # nothing yet, or the start of <think>
                    return events
                self.state = "answer"
            elif self.state == "thinking":
                end = self.pending.find(CLOSE)
                if end < 0:
                    keep = len(self.pending) - trailing_prefix(self.pending, CLOSE)
                    thought, self.pending = self.pending[:keep], self.pending[keep:]
                    return events + ([Thinking(thought)] if thought else [])
                if end:
                    events.append(Thinking(self.pending[:end]))
                self.pending, self.state, self.strip = self.pending[end + len(CLOSE):], "answer", True
            else:
                text, self.pending = self.pending, ""
                if self.strip:
                    text = text.lstrip()
                    self.strip = not text
                return events + ([Text(text)] if text else [])

    def flush(self) -> list:
        """What is held back, once the answer has ended."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        return [Thinking(text)] if self.state == "thinking" else [Text(text)]
