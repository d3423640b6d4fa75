"""A reasoning model's thinking block tracked token by token: kept to a budget (llama.cpp's
`--reasoning-budget N`, its reasoning-budget sampler), and told apart from the answer for a grammar
that shapes only the answer (a JSON schema after DeepSeek-R1's thinking).

    outside --<think>--> thinking (N tokens left) --N counted--> [the last token's UTF-8 whole] --> forcing
       ^                     |                                                                       |
       |                     +--</think> (the model's own)--> done <--the message and </think> forced-+
       +------------------------------------------------------ done --<think> again: a fresh budget

While forcing, the row is the forced token alone: the target's distribution there is that token with
probability 1, for the target alone and for speculation alike, so the answer stays the target's (a
draft token other than it is rejected; see `processing`). The state moves only by tokens kept, in order.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

OPEN, CLOSE = "<think>", "</think>"
PROMPT_TAIL = 16  # the prompt's last tokens read for a block the template (or a prefill) opened


@dataclass(frozen=True)
class ThinkingTags:
    """The block's markers as token ids, and what is forced when the budget runs out."""
    open: tuple[int, ...]
    close: tuple[int, ...]
    forced: tuple[int, ...]   # the budget message's tokens, then `close`

    @classmethod
    def of(cls, tokenize, message: str = "") -> ThinkingTags:
        """The tags in this vocabulary (`tokenize(text)`: special tokens parsed; several tokens where
        the tag is none of its own)."""
        open_ids, close_ids = tuple(tokenize(OPEN)), tuple(tokenize(CLOSE))
        return cls(open_ids, close_ids, tuple(tokenize(message)) + close_ids if message else close_ids)


class ThinkingBlock:
    """Where the answer is relative to the thinking block, and what the budget allows next.

    budget: the most tokens a block may hold (None: no limit, the block only tracked); `piece(token)`:
    the token's bytes, so that the block is not closed in the middle of a character."""

    def __init__(self, tags: ThinkingTags, budget: int | None, piece=None):
        self.tags, self.budget, self._piece = tags, budget, piece
        self.state, self.left, self.n_forced = "outside", 0, 0
        self._recent: tuple[int, ...] = ()  # the last tokens, to match a tag spread over several

    def clone(self) -> ThinkingBlock:
        copy = ThinkingBlock(self.tags, self.budget, self._piece)
        copy.state, copy.left, copy.n_forced, copy._recent = self.state, self.left, self.n_forced, self._recent
        return copy

    @property
    def inside(self) -> bool:
        """Whether the next token is part of a thinking block (the tokens forced to close it included)."""
        return self.state not in ("outside", "done")

    def forced_token(self) -> int | None:
        return self.tags.forced[self.n_forced] if self.state == "forcing" else None

    def read_prompt(self, prompt) -> None:
        """The prompt's tail: the template's assistant turn (DeepSeek-R1's opens the block) or a prefill.
        Its thinking tokens count towards the budget, as llama.cpp counts its generation prompt's."""
        for token in list(prompt)[-PROMPT_TAIL:]:
            self.accept(token)

    def accept(self, token: int) -> None:
        """Move past a token kept in the sequence."""
        self._recent = (self._recent + (token,))[-max(len(self.tags.open), len(self.tags.close)):]
        if self.state in ("outside", "done"):
            if self._ends_with(self.tags.open):
                self.open_block()
        elif self.state == "forcing":
            self.n_forced += 1
            if self.n_forced == len(self.tags.forced):
                self.state, self._recent = "done", ()
        elif self._ends_with(self.tags.close):
            self.state, self._recent = "done", ()
        elif self.state == "thinking":
            self.left -= 1
            if self.left <= 0:
                self.state = "forcing" if self._whole_character(token) else "finishing_character"
        elif self.state == "finishing_character" and self._whole_character(token):
            self.state = "forcing"

    def restrict(self, row: np.ndarray) -> None:
        """While forcing: every logit but the forced token's to -inf (it keeps its own, or 0 if a bias
        ruled it out: the budget's end is no choice the request can forbid)."""
        forced = self.forced_token()
        if forced is None:
            return
        value = row[forced] if np.isfinite(row[forced]) else 0.0
        row.fill(-np.inf)
        row[forced] = value

    def end_now(self) -> bool:
        """End the block from the next token on (llama-server's `reasoning_end` control): the budget
        message and the end forced, as when a budget runs out, after the character under way. False
        where no block is being thought (outside, done, or already ending)."""
        if self.state not in ("thinking", "thinking_unlimited"):
            return False
        whole = not self._recent or self._whole_character(self._recent[-1])
        self.state, self.n_forced = ("forcing" if whole else "finishing_character"), 0
        return True

    def allows(self, token: int) -> bool:
        forced = self.forced_token()
        return forced is None or token == forced

    def open_block(self) -> None:
        self._recent = ()
        if self.budget is None:
            self.state = "thinking_unlimited"
            return
        self.state, self.left, self.n_forced = "thinking", self.budget, 0
        if self.budget <= 0:
            self.state = "forcing"

    def _ends_with(self, tag: tuple[int, ...]) -> bool:
        return self._recent[-len(tag):] == tag

    def _whole_character(self, token: int) -> bool:
        """Whether the token's bytes end on a character's end (llama.cpp waits for that before forcing)."""
        if self._piece is None:
            return True
        return utf8_complete(self._piece(token))


def utf8_complete(data: bytes) -> bool:
    """Whether `data` does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): how long its sequence is
            length = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back >= length
    return True


class ReasoningControl:
    """A running generation's thinking ended from outside it (llama-server's `reasoning_control` and
    POST /v1/chat/completions/control): another thread asks, the generation takes the request at its
    next decided position, so the block ends between two tokens the target chose, never inside a
    verification's bookkeeping."""

    def __init__(self):
        self._asked = threading.Event()

    def request_end(self) -> None:
        self._asked.set()

    def take_end_request(self) -> bool:
        """Whether an end was asked since the last call (the request is taken once)."""
        if not self._asked.is_set():
            return False
        self._asked.clear()
        return True
