"""Stop strings: generation ends where one of them first appears, and the text ends just before it.

`StopFilter` is for text that goes out piece by piece while it is generated (the server's answers,
`ggufspec eval`'s completions); `cut_at_stop` is the same cut on a whole text.
"""
from __future__ import annotations


def first_stop(text: str, stops, start: int = 0) -> int | None:
    """Where the first of `stops` to appear in `text` (at or after `start`) begins; None: nowhere."""
    return min((i for s in stops if (i := text.find(s, start)) >= 0), default=None)


def cut_at_stop(text: str, stops) -> str:
    """`text` up to (not including) the first stop string."""
    end = first_stop(text, stops)
    return text if end is None else text[:end]


def _places(text: str, char: str, span: int):
    """Where `char` appears among the last `span` characters of `text`."""
    i = text.find(char, max(len(text) - span, 0))
    while i >= 0:
        yield i
        i = text.find(char, i + 1)


class StopFilter:
    """Holds pieces back while the text might be running into a stop string; cuts at the first one.

    A piece is a dict with a "text" (and whatever else its owner keeps in it). Pieces go out whole,
    except the one a stop string starts in, which goes out trimmed (pieces after it never go out),
    so the pieces' texts always add up to the text before the first stop string.
    """

    def __init__(self, stops):
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""        # everything generated so far
        self.sent = 0         # characters of it released
        self.pending: list[dict] = []
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, piece: dict) -> list[dict]:
        """The pieces that can go out now that `piece` came (none after a stop string)."""
        if not self.stops:
            return [piece]
        self.pending.append(piece)
        self.text += piece["text"]
        # a stop string never starts in text already released: it would have been held back
        found = first_stop(self.text, self.stops, max(0, self.sent - self.longest))
        if found is not None:
            self.stopped = True
            self.matched = next(s for s in self.stops if self.text.startswith(s, found))
            return self._release(found)
        return self._release(len(self.text) - self._partial_stop_length())

    def flush(self) -> list[dict]:
        """The generation ended without a stop string: what was held back goes out."""
        released, self.pending = self.pending, []
        return released

    def _partial_stop_length(self) -> int:
        """How many trailing characters are the beginning of a stop string: the text's tail from each place
        its first character appears, the longest first (comparing each prefix of a stop string cost the
        square of its length a token: 8-17 s for one of 300,000 characters)."""
        longest = 0
        for stop in self.stops:
            for i in _places(self.text, stop[0], len(stop) - 1):
                if stop.startswith(self.text[i:]):
                    longest = max(longest, len(self.text) - i)
                    break  # the places come in order: the first that fits is this stop's longest
        return longest

    def _release(self, end: int) -> list[dict]:
        released, position = [], self.sent
        while self.pending:
            piece = self.pending[0]
            if position + len(piece["text"]) <= end:
                released.append(self.pending.pop(0))
                position += len(piece["text"])
                continue
            if self.stopped:  # the piece the stop string starts in: its part before the stop string
                if end > position:
                    released.append({**piece, "text": piece["text"][:end - position]})
                    position = end
                self.pending = []
            break
        self.sent = position
        return released


class LineLimits:
    """llama-server's two limits for code completion, applied to pieces as they go out (`apply`):

    - `n_indent`: a line that begins less indented than this ends the answer, its text from the first
      character that is not a space or a tab cut off (an editor asked for the rest of a block; the first
      line is not checked, as the cursor may be anywhere in it);
    - `time_limit_s` (`t_max_predict_ms`): past this long since the first piece, the answer ends at the
      next piece that holds a newline, that piece included (it ends with a whole line)."""

    def __init__(self, n_indent: int = 0, time_limit_s: float | None = None, clock=None):
        import time
        self.n_indent, self.time_limit_s, self.clock = n_indent, time_limit_s, clock or time.monotonic
        self.started: float | None = None
        self.line: str | None = None  # the text of the line under way; None before the first newline
        self.stopped = False

    def apply(self, pieces: list[dict]) -> list[dict]:
        """The pieces that go out: all of them, or up to the one where a limit ends the answer."""
        if self.started is None and pieces:
            self.started = self.clock()
        out = []
        for piece in pieces:
            piece = self._indent_checked(piece)
            out.append(piece)
            if self.stopped:
                break
            if "\n" in piece["text"] and self.time_limit_s is not None and self.clock() - self.started > self.time_limit_s:
                self.stopped = True
                break
        return out

    def _indent_checked(self, piece: dict) -> dict:
        text, start = piece["text"], 0
        while True:
            if self.line is not None and self.n_indent > 0:
                line = self.line + text[start:].split("\n", 1)[0]
                code = len(line) - len(line.lstrip(" \t"))
                if code < len(line) and code < self.n_indent:  # the line's first character is less indented
                    self.stopped = True
                    return {**piece, "text": text[:start + code - len(self.line)]}
            newline = text.find("\n", start)
            if newline < 0:
                self.line = None if self.line is None else self.line + text[start:]
                return piece
            self.line, start = "", newline + 1
