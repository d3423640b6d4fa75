"""A draft model whose vocabulary is smaller than the target's, seen through the target's token ids."""
from __future__ import annotations

import numpy as np

from .errors import Interrupted
from .native import Context, common_prefix_length


class VocabBridge:
    """The draft's context seen through the target's token ids, for a draft whose vocabulary is
    smaller than the target's (llama.cpp pairs models whose sizes differ by up to 128).

    Ids the draft has pass through unchanged (the compatibility check made sure their texts agree);
    an id it lacks is given to it as its own tokenization of that token's text, zero or more draft
    tokens. `ends[i]` is the draft cache's length after the sequence's first i + 1 tokens, so
    cutting back (`keep`) and prefix reuse still count in the target's tokens, as for a plain Context.
    """

    def __init__(self, draft: Context, target: Context):
        self.inner, self.target = draft, target
        self.n_ctx, self.n_vocab, self.name = draft.n_ctx, draft.n_vocab, draft.name
        self.tokens: list[int] = []
        self.ends: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def is_end_of_generation(self, token: int) -> bool:  # a drafted id is one of the draft's own
        return self.inner.is_end_of_generation(token)

    def _draft_ids(self, token: int) -> list[int]:
        if token < self.inner.n_vocab:
            return [token]
        text = self.target.piece(token)
        return self.inner.llm.tokenize(text, add_bos=False, special=False) if text else []

    def decode(self, tokens, n_logits: int = 1) -> None:
        ids, ends, end = [], [], len(self.inner.tokens)
        for token in tokens:
            ids += self._draft_ids(token)
            ends.append(end + len(ids))
        try:
            if ids:
                self.inner.decode(ids, n_logits=min(n_logits, len(ids)))
        except Interrupted:  # stopped between chunks (`should_stop`): keep the target tokens evaluated whole
            whole = sum(1 for e in ends if e <= len(self.inner.tokens))
            self.inner.keep(ends[whole - 1] if whole else end)
            self.tokens.extend(tokens[:whole])
            self.ends.extend(ends[:whole])
            raise
        self.tokens.extend(tokens)
        self.ends.extend(ends)

    @property
    def should_stop(self):
        return self.inner.should_stop

    @should_stop.setter
    def should_stop(self, value) -> None:  # a long catch-up stops as the draft's own context would
        self.inner.should_stop = value

    def logits(self, row: int) -> np.ndarray:
        return self.inner.logits(row)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def keep(self, n_tokens: int) -> None:
        if n_tokens >= len(self.tokens):
            return
        self.inner.keep(self.ends[n_tokens - 1] if n_tokens else 0)
        del self.tokens[n_tokens:], self.ends[n_tokens:]

    def reuse_prefix(self, tokens) -> int:
        self.keep(common_prefix_length(self.tokens, tokens))
        return len(self.tokens)

    def checkpoint(self, upcoming: int = 1, persistent: bool = False, force: bool = False) -> None:
        self.inner.checkpoint(upcoming, persistent, force)

    def close(self) -> None:
        self.inner.close()
