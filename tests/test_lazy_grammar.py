"""A lazy grammar whose trigger shows in the output followed by text the grammar rejects: llama.cpp
threw "Unexpected empty grammar stack" through its C API, which aborted the process (the server
with it). Now the token is not accepted and the rest of the answer is free; greedy, the text is the
target alone's whatever drafts it (`ggufspec.grammar`)."""
import re
import subprocess
import sys

import pytest

from ggufspec import SpeculativeDecoder
from ggufspec.grammar import Grammar, Trigger, mirrored
from ggufspec.processing import Constraints

HERMES_RUN = """
import sys
import llama_cpp
from ggufspec import tools as toolkit
from ggufspec.processing import Grammar
from ggufspec.server.constraints import engine_constraints, shaping
from ggufspec.server.schemas import ChatBody
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
fmt = toolkit.detect_format("{{ messages }}")  # no tools in the template: the hermes fallback
body = ChatBody(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "now"}}])
grammar = Grammar(vocab, engine_constraints(shaping(body, fmt, 300), ()))
tokens = [3 + byte for byte in sys.argv[2].encode()] + [int(t) for t in sys.argv[3:]]  # byte tokens, then others
print("".join("1" if grammar.accept(token) else "0" for token in tokens))
"""


@pytest.fixture(scope="module")
def glued(tmp_path_factory):
    """The tiny vocabulary with a token `>,` (id 277): a call's opening glued to what follows it."""
    from ggufspec.tinymodels import Shape, make_weights, vocabulary, write_model
    tokens = vocabulary()[0]
    tokens[277] = ">,"
    return write_model(tmp_path_factory.mktemp("glued") / "glued.gguf", Shape(), make_weights(Shape(), 0), tokens=tokens)


CALL = '<tool_call>\n{"name": "now", "arguments": {}}'


@pytest.mark.parametrize("answer, more, accepted", [
    ("I will call <tool_call", [277], "1" * len("I will call <tool_call") + "0"),  # `>,`: the trigger, then no call
    (CALL, [], "1" * len(CALL)),                                                   # a call: constrained as before
])
def test_a_tool_trigger_followed_by_no_call_does_not_abort_the_server(glued, answer, more, accepted):
    """A vocabulary without a `<tool_call>` token spells it in pieces, and its last piece may carry
    more (`>,`): the grammar is fed the text from the trigger's start, `,` included. The subprocess
    (the server, in its place) ended with SIGABRT."""
    run = subprocess.run([sys.executable, "-c", HERMES_RUN, str(glued), answer, *map(str, more)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-500:]
    assert run.stdout.strip() == accepted


@pytest.fixture(scope="module")
def strict_decoder(tiny_pair):
    with SpeculativeDecoder(*tiny_pair, n_ctx=256, n_threads=1, strict=True) as decoder:
        yield decoder


def word_in_free_text(decoder) -> tuple[str, str]:
    text = decoder.generate("the cat", n_predict=24, n_draft=0).text
    words = re.findall(r"[a-z]{2,}", text)
    assert words, text
    return text, words[0]


@pytest.mark.parametrize("n_draft", [0, 3, "lookup"])
def test_a_grammar_rejecting_its_own_trigger_gives_the_free_text_not_an_abort(strict_decoder, n_draft, capfd):
    free, word = word_in_free_text(strict_decoder)
    lazy = Constraints(grammar='root ::= "zzz"', grammar_patterns=(word,))
    options = dict(n_predict=24, constraints=lazy)
    if n_draft == "lookup":
        out = strict_decoder.generate("the cat", n_draft="auto", **options)  # n-gram drafts as well
    else:
        out = strict_decoder.generate("the cat", n_draft=n_draft, **options)
    assert out.text == free
    assert "followed by text the grammar rejects" in capfd.readouterr().err


def test_a_trigger_token_whose_text_the_grammar_rejects_is_no_abort_either(strict_decoder):
    free = strict_decoder.generate("the cat", n_predict=16, n_draft=0)
    token = free.tokens[2]
    lazy = Constraints(grammar='root ::= "zzz"', grammar_trigger_tokens=(token,))
    assert strict_decoder.generate("the cat", n_predict=16, n_draft=3, constraints=lazy).tokens == free.tokens


@pytest.mark.parametrize("n_draft", [0, 3])
def test_the_penalties_and_dry_go_on_after_a_rejected_trigger(strict_decoder, n_draft):
    """Only the grammar is dropped: DRY's sampler was freed with it, and the next row read freed memory (a
    segfault, found by a differential fuzz). The answer is the free one under the same DRY and penalties."""
    penalties = dict(dry_multiplier=0.5, frequency_penalty=0.5, ignore_eos=True)
    free = strict_decoder.generate("the cat", n_predict=32, n_draft=0, constraints=Constraints(**penalties))
    lazy = Constraints(grammar='root ::= "zzz"', grammar_trigger_tokens=(free.tokens[2],), **penalties)
    assert strict_decoder.generate("the cat", n_predict=32, n_draft=n_draft, constraints=lazy).tokens == free.tokens


@pytest.mark.parametrize("n_draft", [0, 3])
def test_a_grammar_that_takes_its_trigger_still_shapes_what_follows(strict_decoder, n_draft):
    free, word = word_in_free_text(strict_decoder)
    lazy = Constraints(grammar=f'root ::= "{word}" " ab" [ab]*', grammar_patterns=(word,))
    out = strict_decoder.generate("the cat", n_predict=24, n_draft=n_draft, constraints=lazy)
    head, _, tail = out.text.partition(word)
    assert head == free.partition(word)[0] and tail.startswith(" ab") and set(tail[1:]) <= set("ab")


def test_the_mirror_replays_what_llama_cpp_replays():
    """llama_grammar_trigger_pattern::find: the first non-empty group's start, else the match's; the
    tokens overlapping it replayed, the first one cut at that start; ^...$ matched whole."""
    trigger = Trigger(patterns=(r"say (<call>)",))
    assert trigger.fires(1, b"I say") is None and trigger.fires(2, b" <ca") is None
    assert trigger.fires(3, b"ll>{") == [(2, b"<ca"), (3, b"ll>{")] and not trigger.awaiting
    whole = Trigger(patterns=(r"^[\s\S]*?(\{)[\s\S]*$",))
    assert whole.fires(1, b"a {b") == [(1, b"{b")]
    no_group = Trigger(patterns=(r"<x>",))
    assert no_group.fires(7, b"..<x") is None and no_group.fires(8, b">!") == [(7, b"<x"), (8, b">!")]
    by_token = Trigger(tokens=(9,))
    assert by_token.fires(4, b"a") is None and by_token.fires(9, b"[T]") == [(9, b"[T]")]


def test_the_mirror_reads_a_pattern_as_ecmascript_does(tmp_path):
    """Python's `$` also matches before a final newline, its `.` takes \\r, its bytes regexes refuse
    \\uHHHH: the mirror fired where llama.cpp did not (then stopped watching, and llama.cpp fired later
    on text the grammar rejects: an abort), or dropped the pattern. Both found by review."""
    import llama_cpp
    from ggufspec.tinymodels import Shape, make_weights, vocabulary, write_model
    assert mirrored(r"[a-z]x$").search(b"ax\n") is None and mirrored(r"a.b").search(b"a\rb") is None
    assert mirrored(r"\u0061b").search(b"xab")
    tokens = vocabulary()[0]
    tokens[277], tokens[278] = "ax\n", "bx"
    path = write_model(tmp_path / "dollar.gguf", Shape(), make_weights(Shape(), 0), tokens=tokens)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        grammar = Grammar(vocab, Constraints(grammar='root ::= "ax\\n" [a-z]*', grammar_patterns=(r"[a-z]x$",)))
        assert grammar.accept(277) and not grammar.accept(278)  # llama.cpp fires on `bx`, which it rejects
        grammar.close()
    finally:
        llm.close()
