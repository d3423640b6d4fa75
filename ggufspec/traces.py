"""Recording acceptance traces (`ggufspec bench --record-trace FILE`); `simulate` reads and replays them.

The trick that makes a trace cheap and exact: run the target alone greedily, then give the draft
the same sequence in one teacher-forced batch and take its argmax at every position. While a greedy
draft agrees with the target its next input *is* the target's token, so the length of the run of
agreements starting at position i is exactly how far a draft proposing from position i would have
agreed. One target run and one draft batch per prompt give every position's answer, for any K.
(Exact up to batch rounding: a batch's logits can differ from one-token decodes in the last bits,
which only matters at near-ties.)
"""
from __future__ import annotations

import os
import time

import numpy as np

from .errors import GgufspecError
from .sampling import greedy_token
from .simulate import PromptTrace, Trace, pair_identity, runs_from_agreement, write_trace


def _probability_of_best(logits: np.ndarray) -> float:
    """softmax(logits)[argmax]: what --draft-p-min compares (3 decimals are plenty)."""
    shifted = logits.astype(np.float64) - float(logits.max())
    return round(float(1.0 / np.exp(shifted).sum()), 3)


def draft_predictions(draft, sequence: list[int], n_prompt: int) -> tuple[list[int], list[float]]:
    """The draft's greedy token and its probability at every generated position of `sequence`,
    teacher-forced: position j is predicted from sequence[:n_prompt + j]."""
    draft.reuse_prefix(sequence[:n_prompt - 1])
    draft.decode(sequence[draft.n_past:n_prompt - 1], n_logits=0)
    tokens, probabilities = [], []
    inputs = sequence[n_prompt - 1:-1]
    bridged = hasattr(draft, "inner")  # a VocabBridge maps a token to several rows: one at a time
    step = 1 if bridged else draft.n_batch
    for start in range(0, len(inputs), step):
        chunk = inputs[start:start + step]
        draft.decode(chunk, n_logits=len(chunk))
        for row in range(len(chunk)):
            logits = draft.logits(row)
            tokens.append(greedy_token(logits))
            probabilities.append(_probability_of_best(logits))
    return tokens, probabilities


def end_token(target, sequence: list[int]) -> int:
    """The target's greedy token after `sequence` (the end marker a generation stopped on)."""
    target.reuse_prefix(sequence[:-1])
    target.decode(sequence[target.n_past:], n_logits=1)
    return greedy_token(target.logits(0))


class TraceRecorder:
    """Collects one PromptTrace per prompt from the target's greedy runs, then writes the file."""

    def __init__(self, decoder, n_predict: int):
        if decoder.draft is None:
            raise GgufspecError("--record-trace needs a draft model (-md, or a pair)")
        self.decoder, self.n_predict = decoder, n_predict
        self.identity = pair_identity(decoder.target_llm.model_path, decoder.draft_llm.model_path)
        self.prompts: list[PromptTrace] = []
        self.seconds = 0.0

    def add(self, item: dict, generated: list[int] | None = None, stop_reason: str = "") -> PromptTrace:
        """One prompt: `generated` from a greedy run of the target alone, else a run made here."""
        dec = self.decoder
        started = time.perf_counter()
        chat = item.get("kind") == "chat"
        prompt = dec.tokenize(item["prompt"], chat=chat, system=item.get("system") if chat else None)
        if generated is None:
            gen = dec.generate(prompt, n_predict=self.n_predict, n_draft=0, temperature=0.0)
            generated, stop_reason = gen.tokens, gen.stats.stop_reason
        sequence = prompt + list(generated)
        eos = stop_reason == "eos"
        if eos:  # the end marker is a position too: the draft may agree on it
            sequence.append(end_token(dec.target, sequence))
        proposed, probabilities = draft_predictions(dec.draft, sequence, len(prompt))
        agrees = [p == t for p, t in zip(proposed, sequence[len(prompt):])]
        trace = PromptTrace(item["id"], item.get("kind", "raw"), len(prompt), runs_from_agreement(agrees), eos,
                            probabilities, sequence, self.n_predict)
        self.prompts.append(trace)
        self.seconds += time.perf_counter() - started
        return trace

    def trace(self) -> Trace:
        return Trace(self.identity, self.prompts, meta={"n_predict": self.n_predict})

    def write(self, path, meta: dict | None = None) -> Trace:
        if not self.prompts:
            raise GgufspecError("--record-trace: no prompt was run, nothing to record")
        meta = {"n_predict": self.n_predict, **(meta or {})}
        write_trace(path, self.identity, self.prompts, meta)
        return Trace(self.identity, self.prompts, os.fspath(path), meta)
