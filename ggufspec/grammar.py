"""llama.cpp's grammar sampler, wrapped once, and what keeps a lazy grammar from aborting the process.

A lazy grammar (tool calls under `tool_choice: auto`) lets every token through until a trigger shows
in the output: a trigger token, or a pattern (an ECMAScript regex) found in the text so far. llama.cpp
then replays the text from the trigger into the grammar (llama_grammar_accept_impl: from the pattern's
first non-empty group, else from its match), and where the grammar rejects that text it throws inside
its C API, which ends the process ("Unexpected empty grammar stack"). A model may well write a
trigger followed by something else (`<tool_call>,` where `<tool_call>` is several tokens, the last of
them `>,`). So `Trigger` mirrors llama.cpp's waiting state, and before a token that fires it is
accepted, `Grammar` runs the replayed text through a fresh copy of the grammar, token by token, with
`allows` (which never throws). A token whose text the grammar rejects is not accepted: `accept`
returns False, and the caller decides (the target's processor stops constraining, a draft stops).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile

import llama_cpp
import numpy as np

from .errors import GgufspecError
from .llamalog import FD2_SWAP, grammar_refusals
from .native import token_piece

_TOKEN_DATA = np.dtype(  # llama_token_data
    [("id", np.int32), ("logit", np.float32), ("p", np.float32)])

# What ECMAScript regexes (llama.cpp's std::regex) lack of Python's: named groups, lookbehind, inline
# flags, comments, atomic groups, possessive quantifiers, `{,n}`, the escapes \A \Z \a \N \U. std::regex
# throws on them, which aborts the process.
NOT_ECMASCRIPT = re.compile(r"\(\?(?:P|<|[a-zA-Z#>]|\()|[*+?}][+]|\{,")
NOT_ECMASCRIPT_ESCAPE = re.compile(r"\\[AZaNU]")


def check_trigger_pattern(pattern: str) -> None:
    """A lazy grammar's trigger: a regex llama.cpp's std::regex can compile (an invalid one aborts it),
    and that `Trigger` reads as llama.cpp does."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise GgufspecError(f"grammar_patterns: {pattern!r} is not a regular expression ({exc})") from None
    plain = re.sub(r"\[\^?\]?[^\]]*\]", "_", re.sub(r"\\.", "_", pattern))  # escapes and classes aside
    if NOT_ECMASCRIPT.search(plain) or NOT_ECMASCRIPT_ESCAPE.search(re.sub(r"\\\\", "", pattern)):
        raise GgufspecError(f"grammar_patterns: {pattern!r} uses syntax llama.cpp's regexes (ECMAScript) lack: "
                            "named or lookbehind groups, inline flags, atomic groups, possessive quantifiers, "
                            "{,n}, or the escapes \\A \\Z \\a \\N \\U")
    mirrored(pattern)


def mirrored(pattern: str) -> re.Pattern:
    """The pattern as a Python bytes regex that reads as ECMAScript's does (std::regex over bytes): `$`
    only at the very end (Python's also before a final newline), `.` no line end (Python's takes \\r),
    `\\uHHHH` an ASCII character; the output is searched as bytes, as llama.cpp searches its buffer."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = pattern[i:i + 2]
            if escape == "\\u":
                code = pattern[i + 2:i + 6]
                if not re.fullmatch(r"[0-9a-fA-F]{4}", code) or int(code, 16) > 0x7F:
                    raise GgufspecError(f"grammar_patterns: {pattern!r}: write \\u{code} as the character itself "
                                        "(llama.cpp matches its bytes)")
                out.append(f"\\x{int(code, 16):02x}")
                i += 6
                continue
            out.append(escape)
            i += 2
            continue
        if in_class:
            in_class = c != "]" or out[-1] in ("[", "[^")
            out.append(c)
        elif c == "[":
            in_class = True
            out.append("[^" if pattern[i + 1:i + 2] == "^" else "[")
            i += 1 if pattern[i + 1:i + 2] == "^" else 0
        else:
            out.append({"$": r"\Z", ".": r"[^\n\r]"}.get(c, c))
        i += 1
    try:
        return re.compile("".join(out).encode())
    except re.error as exc:
        raise GgufspecError(f"grammar_patterns: {pattern!r} is not a regular expression llama.cpp reads ({exc})") from None


class Trigger:
    """llama.cpp's `awaiting_trigger` state, mirrored: the output buffered so far (each token's span in
    it), and whether a token fires the trigger and with what text (`fires`)."""

    def __init__(self, patterns=(), tokens=()):
        # llama_grammar_trigger_pattern::find: ^...$ is matched against the whole text first
        self.patterns = [(mirrored(p), p.startswith("^") and p.endswith("$")) for p in patterns]
        self.tokens = frozenset(tokens)
        self.awaiting = bool(patterns or tokens)
        self.buffer, self.spans = b"", []

    def copy(self) -> Trigger:
        twin = Trigger.__new__(Trigger)
        twin.patterns, twin.tokens, twin.awaiting = self.patterns, self.tokens, self.awaiting
        twin.buffer, twin.spans = self.buffer, list(self.spans)
        return twin

    def fires(self, token: int, piece: bytes) -> list[tuple[int, bytes]] | None:
        """The (token, text) pairs llama.cpp replays into the grammar when `token` fires the trigger;
        None where it does not (the token is then only buffered, as llama.cpp does)."""
        if token in self.tokens:
            self.awaiting, self.buffer, self.spans = False, b"", []
            return [(token, piece)]
        start = len(self.buffer)
        self.buffer += piece
        self.spans.append((token, start, len(self.buffer)))
        for regex, whole in self.patterns:
            found = (whole and regex.fullmatch(self.buffer)) or regex.search(self.buffer)
            if found:
                begin = next((found.start(i) for i in range(1, (found.re.groups or 0) + 1)
                              if found.start(i) >= 0 and found.end(i) > found.start(i)), found.start())
                replay = [(tok, self.buffer[max(s, begin):e]) for tok, s, e in self.spans if e > begin]
                self.awaiting, self.buffer, self.spans = False, b"", []
                return replay
        return None


# llama.cpp's GBNF parser prints why it refuses a grammar to fd 2 (fprintf: "parse: error parsing grammar:
# REASON\n\nGRAMMAR\n"), not to its log; the sampler's checks after it (no root, left recursion) go to the log
PARSE_ERROR = "error parsing grammar: "


class ParserSaid:
    reason = ""


@contextlib.contextmanager
def parser_said(grammar: str):
    """fd 2 read for the block (a grammar's init, milliseconds): a ParserSaid whose `reason` is the parser's for
    `grammar`, cut to a line. One capture at a time, and none while a model loads (llama-cpp-python points fd 2
    elsewhere then: the two would restore each other's); what else reached fd 2 meanwhile (another thread's log
    line) is written back to it. Without a usable fd 2 (closed), nothing is read."""
    said = ParserSaid()
    with FD2_SWAP, tempfile.TemporaryFile() as captured:
        grammar_refusals()  # the log's, from here on
        try:
            if sys.stderr is not None:
                sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):
            yield said
            return
        os.dup2(captured.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            said.reason, text = _parser_report(text, grammar)
            said.reason = said.reason or "; ".join(grammar_refusals())
            if text:
                os.write(2, text.encode())  # fd 2 as it was written (sys.stderr may copy to --log-file: done)


def _parser_report(text: str, grammar: str) -> tuple[str, str]:
    """(the parser's reason, cut to 120 characters; "" for none) and `text` without its report."""
    start = text.find(PARSE_ERROR)
    if start < 0:
        return "", text
    line_start, reason_end = text.rfind("\n", 0, start) + 1, text.find("\n", start)
    reason = text[start + len(PARSE_ERROR):reason_end if reason_end >= 0 else len(text)]
    report_end = reason_end + len(f"\n\n{grammar}\n") if text.startswith(f"\n\n{grammar}\n", reason_end) else \
        (reason_end + 1 if reason_end >= 0 else len(text))
    return (reason if len(reason) <= 120 else reason[:117] + "..."), text[:line_start] + text[report_end:]


class Grammar:
    """llama.cpp's grammar sampler (lazy when trigger patterns or tokens are given), wrapped once.
    `c`: anything with grammar, grammar_root, grammar_patterns and grammar_trigger_tokens."""

    def __init__(self, vocab, c):
        self._vocab, self._text, self._root = vocab, c.grammar.encode(), c.grammar_root.encode()
        with parser_said(c.grammar) as said:
            if c.grammar_patterns or c.grammar_trigger_tokens:
                patterns = (ctypes.c_char_p * max(1, len(c.grammar_patterns)))(*[p.encode() for p in c.grammar_patterns])
                tokens = (llama_cpp.llama_token * max(1, len(c.grammar_trigger_tokens)))(*c.grammar_trigger_tokens)
                self._sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                    vocab, self._text, self._root, patterns, len(c.grammar_patterns), tokens,
                    len(c.grammar_trigger_tokens))
            else:
                self._sampler = llama_cpp.llama_sampler_init_grammar(vocab, self._text, self._root)
        if not self._sampler:
            raise GgufspecError(f"the grammar does not parse: {said.reason or 'llama.cpp GBNF parser refused it'}")
        self._trigger = Trigger(c.grammar_patterns, c.grammar_trigger_tokens)
        self._pieces: dict[int, bytes] = {}

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of the tokens the grammar forbids here to -inf, in place (the whole
        vocabulary: tens of ms for 150k tokens, more than a small model's step)."""
        logits[~self.allows(np.arange(len(logits)), logits)] = -np.inf

    def mask_all_but_best(self, logits: np.ndarray, n: int) -> None:
        """Keep the n highest tokens the grammar allows, -inf elsewhere: exact for greedy (n = 1) and
        top-k (n = k), as the masked row's best n are these. llama.cpp's check-the-choice-first trick:
        try the best n, then the best 64 n, then the whole vocabulary."""
        for size in (n, 64 * n):
            if size >= len(logits):
                break
            best = np.argpartition(-logits, size - 1)[:size]
            allowed = best[self.allows(best, logits[best])]
            if len(allowed) >= n:  # any allowed token outside `best` ranks below all of these
                kept = logits[allowed]
                logits[:] = -np.inf
                logits[allowed] = kept
                return
        self.mask(logits)

    def allows(self, ids: np.ndarray, logits: np.ndarray, sampler=None) -> np.ndarray:
        """For each token id, whether the grammar allows it next (llama.cpp's sampler sets -inf)."""
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"], data["logit"] = ids, logits
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(llama_cpp.llama_token_data_p), size=len(ids), selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(sampler or self._sampler, ctypes.byref(array))
        allowed = np.zeros(len(ids), dtype=bool)  # the sampler keeps the entries, in order, setting -inf
        allowed[:array.size] = np.isfinite(data["logit"][:array.size])
        return allowed

    def accept(self, token: int) -> bool:
        """Walk past the token; False (and nothing accepted) where it fires a lazy grammar's trigger
        onto text the grammar rejects (see the module's note): this grammar is then done with."""
        if self._trigger.awaiting:
            replay = self._trigger.fires(token, self._piece(token))
            if replay is not None and not self._takes(replay):
                return False
        llama_cpp.llama_sampler_accept(self._sampler, token)
        return True

    def _takes(self, replay: list[tuple[int, bytes]]) -> bool:
        """Whether the grammar, from its start, takes the replayed text: each whole piece as its token;
        a piece cut by the trigger's start as the tokens that spell it exactly (else it counts as rejected)."""
        fresh = llama_cpp.llama_sampler_init_grammar(self._vocab, self._text, self._root)
        try:
            for token, text in replay:
                for part in [token] if text == self._piece(token) else self._spelling(text):
                    if part is None or not self.allows(np.array([part]), np.zeros(1, np.float32), fresh)[0]:
                        return False
                    llama_cpp.llama_sampler_accept(fresh, part)
            return True
        finally:
            llama_cpp.llama_sampler_free(fresh)

    def _spelling(self, text: bytes) -> list[int | None]:
        """Tokens whose pieces are exactly `text`: its tokenization, where that spells it exactly (a
        tokenizer that puts a space in front does not), else a token per byte; None for a byte no token spells."""
        ids = (llama_cpp.llama_token * (len(text) + 8))()
        n = llama_cpp.llama_tokenize(self._vocab, text, len(text), ids, len(ids), False, False)
        tokens = list(ids[:max(n, 0)])
        if n > 0 and b"".join(map(self._piece, tokens)) == text:
            return tokens
        return [self._byte_token(byte) for byte in text]

    def _byte_token(self, byte: int) -> int | None:
        """A token whose piece is this one byte (SentencePiece's <0xXX>, byte-level BPE's own), found
        by a walk through the vocabulary that stops there (they come first in both)."""
        wanted = bytes([byte])
        for token, piece in self._pieces.items():
            if piece == wanted:
                return token
        for token in range(llama_cpp.llama_vocab_n_tokens(self._vocab)):
            if self._piece(token) == wanted:
                return token
        return None

    def _piece(self, token: int) -> bytes:
        """The token's text as the grammar reads it (llama.cpp's token_to_piece, special tokens spelled out)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = token_piece(self._vocab, token, special=True)
        return cached

    def clone(self) -> Grammar:
        """An independent copy in the same state (llama_sampler_clone), to walk ahead of this one."""
        twin = Grammar.__new__(Grammar)
        twin._sampler = llama_cpp.llama_sampler_clone(self._sampler)
        if not twin._sampler:
            raise GgufspecError("could not copy the grammar's state")
        twin._vocab, twin._text, twin._root, twin._pieces = self._vocab, self._text, self._root, self._pieces
        twin._trigger = self._trigger.copy()
        return twin

    def close(self) -> None:
        if getattr(self, "_sampler", None):
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self):
        self.close()
