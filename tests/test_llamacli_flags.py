"""llama-completion's and llama-cli's flags on `run` and `chat` (ggufspec.cli.llamacli_flags): what each
one does, on the tiny pair, against the engine; the refused ones as one line, before anything loads."""
import codecs
import json
import re

import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder
from ggufspec.cli import main
from ggufspec.stops import cut_at_stop
from clierrors import one_line_error

PROMPT = "the cat sat"
BIAS_BOS = ["-l", "1+100"]  # <s>, a control token that is no end of generation: printed as nothing without -sp


def run(tiny_pair, *flags):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-c", "256", "-t", "1",
                                     "--temp", "0", "-n", "24", "-p", PROMPT, *flags])


def run_json(tiny_pair, *flags) -> dict:
    result = run(tiny_pair, "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def chat(tiny_pair, stdin: str, *flags):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["chat", "-m", str(target), "-md", str(draft), "-c", "256", "-t", "1",
                                     "--temp", "0", "-n", "16", *flags], input=stdin)


@pytest.fixture
def decoder(tiny_pair):
    """A fresh decoder: a conversation's turns reuse its cache as the chat command's do."""
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as fresh:
        yield fresh


def stats_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r"^\[\d+ tokens, ", line)]


def test_help_lists_the_implemented_flags():
    run_help = CliRunner().invoke(main, ["run", "--help"]).output
    for flag in ("-sysf, --system-prompt-file", "-r, --reverse-prompt", "-sp, --special", "--verbose-prompt",
                 "--display-prompt / --no-display-prompt", "-ptc, --print-token-count"):
        assert flag in run_help, flag
    chat_help = CliRunner().invoke(main, ["chat", "--help"]).output
    for flag in ("-sysf, --system-prompt-file", "-r, --reverse-prompt", "-sp, --special", "--verbose-prompt",
                 "-p, --prompt", "-st, --single-turn", "-mli, --multiline-input", "--show-timings / --no-show-timings",
                 "-o, --output, --output-file", "--simple-io"):
        assert flag in chat_help, flag
    for refused in ("--conversation", "--interactive", "--prompt-cache", "--no-jinja", "--grp-attn-n"):
        assert refused not in run_help and refused not in chat_help, refused


def test_run_reverse_prompt_stops_after_the_token_that_completes_it(tiny_pair, tiny_decoder):
    """llama-completion prints a token, then finds the reverse prompt at the output's end: the text ends with
    the piece that completes it. Drafted by the draft model (K 3), the tokens before it are the target alone's."""
    plain = run_json(tiny_pair, "--draft", "3")
    alone = tiny_decoder.generate(PROMPT, n_predict=24, n_draft=0, temperature=0)
    assert plain["tokens"] == alone.tokens and plain["stats"]["n_drafted"] > 0
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [utf8.decode(tiny_decoder.target.piece(t)) for t in alone.tokens]  # as the stream decodes them
    stop = alone.text[len(alone.text) // 2:len(alone.text) // 2 + 3]  # mid-answer, over a piece boundary or not
    n_kept = next(n for n in range(1, len(pieces) + 1) if stop in "".join(pieces[:n]))
    stopped = run_json(tiny_pair, "--draft", "3", "-r", stop, "-r", "never there")
    assert stopped["tokens"] == alone.tokens[:n_kept] and n_kept < len(alone.tokens)
    assert stopped["text"] == "".join(pieces[:n_kept]) and stop in stopped["text"]
    assert stopped["stats"]["stop_reason"] == "stop"
    printed = run(tiny_pair, "--draft", "3", "-r", stop)  # the same text streamed, the statistics say why it ended
    assert printed.exit_code == 0 and printed.stdout == stopped["text"]
    assert "stop:   stop" in printed.stderr
    escaped = "".join(f"\\x{ord(c):02x}" if c.isascii() else c for c in stop)  # -e processes them, as llama.cpp's
    assert run_json(tiny_pair, "--draft", "3", "-e", "-r", escaped)["tokens"] == stopped["tokens"]


def test_run_reverse_prompt_of_one_control_token(tiny_pair):
    """A reverse prompt that is one token stops at that token even where the text never shows it (llama.cpp's
    check by token): <s> prints nothing without -sp."""
    forced = run_json(tiny_pair, *BIAS_BOS, "-n", "6")
    assert forced["tokens"] == [1] * 6 and forced["text"] == ""
    stopped = run_json(tiny_pair, *BIAS_BOS, "-n", "6", "-r", "<s>")
    assert stopped["tokens"] == [1] and stopped["stats"]["stop_reason"] == "stop"


def test_special_prints_control_tokens_with_the_same_tokens(tiny_pair):
    plain, special = run_json(tiny_pair, *BIAS_BOS, "-n", "4"), run_json(tiny_pair, *BIAS_BOS, "-n", "4", "-sp")
    assert plain["text"] == "" and special["text"] == "<s>" * 4 and plain["tokens"] == special["tokens"]
    shown = run(tiny_pair, *BIAS_BOS, "-n", "4", "-sp")
    assert shown.exit_code == 0 and shown.stdout == "<s>" * 4


def test_display_prompt_and_verbose_prompt(tiny_pair, tiny_decoder):
    """--display-prompt: the prompt's tokens as text, then the answer (the BOS shown with -sp only);
    --verbose-prompt: llama-completion's lines on stderr, the prompt and each token."""
    answer = run_json(tiny_pair)["text"]
    tokens = tiny_decoder.tokenize(PROMPT)
    llm = tiny_decoder.target_llm
    for flags, special in (([], False), (["-sp"], True)):
        result = run(tiny_pair, "--display-prompt", *flags)
        assert result.exit_code == 0, result.output
        assert result.stdout == llm.detokenize(tokens, special=special).decode() + answer
    hidden = run(tiny_pair, "--no-display-prompt")
    assert hidden.exit_code == 0 and hidden.stdout == answer
    verbose = run(tiny_pair, "--verbose-prompt")
    assert verbose.exit_code == 0 and verbose.stdout == answer
    lines = verbose.stderr.splitlines()
    start = lines.index(f"prompt: '{PROMPT}'")
    assert lines[start + 1] == f"number of tokens in prompt = {len(tokens)}"
    assert lines[start + 2] == "     1 -> '<s>'"
    assert [int(line.split(" -> ")[0]) for line in lines[start + 2:start + 2 + len(tokens)]] == tokens


def test_print_token_count(tiny_pair):
    result = run(tiny_pair, "-ptc", "5", "-n", "12", "--ignore-eos")
    assert result.exit_code == 0, result.output
    counts = [int(n) for n in re.findall(r"^Tokens consumed so far = (\d+) / 256$", result.stderr, re.M)]
    n_prompt = int(re.search(r"encoded\s+(\d+) tokens", result.stderr).group(1))
    assert counts == [n for n in range(n_prompt + 1, n_prompt + 13) if n % 5 == 0]


def test_system_prompt_file_is_system(tiny_pair, tmp_path):
    system = tmp_path / "system.txt"
    system.write_text("be brief\n")  # llama.cpp drops the file's last newline
    from_file = run_json(tiny_pair, "--chat", "-sysf", str(system))
    assert from_file == {**run_json(tiny_pair, "--chat", "-sys", "be brief"), "stats": from_file["stats"]}
    assert from_file["stats"]["n_prompt"] > run_json(tiny_pair, "--chat")["stats"]["n_prompt"]  # it is in the prompt
    said = chat(tiny_pair, "hi\n", "-sysf", str(system))
    assert said.exit_code == 0 and said.stdout == chat(tiny_pair, "hi\n", "-sys", "be brief").stdout


def test_flags_for_what_run_does_anyway_change_nothing(tiny_pair):
    plain = run_json(tiny_pair)
    taken = run_json(tiny_pair, "-no-cnv", "--jinja", "--simple-io", "--no-warmup", "--no-context-shift",
                     "--reasoning-format", "none", "-gan", "1", "-gaw", "512", "--no-display-prompt")
    assert taken["tokens"] == plain["tokens"] and taken["text"] == plain["text"]
    templated = run_json(tiny_pair, "--chat")
    assert run_json(tiny_pair, "--chat", "-st", "--jinja")["tokens"] == templated["tokens"]


@pytest.mark.parametrize("flags, says", [
    (["-cnv"], "`ggufspec chat`"),
    (["--conversation"], "-cnv/--conversation"),
    (["-no-cnv", "--chat"], "give one of them"),
    (["-i"], "`ggufspec chat` is the interactive mode"),
    (["-if"], "-if/--interactive-first"),
    (["-mli"], "ggufspec chat -mli"),
    (["--in-prefix", "User: "], "--in-prefix"),
    (["--in-suffix", "Bot: "], "--in-suffix"),
    (["--in-prefix-bos"], "--in-prefix-bos"),
    (["--prompt-cache", "cache.bin"], "no prompt state between runs"),
    (["--prompt-cache-all"], "--prompt-cache-all"),
    (["--prompt-cache-ro"], "--prompt-cache-ro"),
    (["-gan", "4", "-gaw", "1024"], "group attention"),
    (["-st"], "give --chat"),
    (["--no-jinja"], "with Jinja"),
    (["--context-shift"], "raise -c"),
    (["--warmup"], "no warmup run"),
    (["--reasoning-format", "deepseek"], "reasoning_content"),
    (["--display-prompt", "--json"], "give one of them"),
    (["-sysf", "system.txt"], "give --chat too"),
    (["--chat", "-sys", "x", "-sysf", "system.txt"], "not both"),
    (["--chat", "-sysf", "/nonexistent/system.txt"], "No such file"),
    (["-r", ""], "an empty one"),
])
def test_run_refuses_in_one_line(tiny_pair, flags, says):
    one_line_error(run(tiny_pair, *flags), says)


@pytest.mark.parametrize("flags, says", [
    (["--display-prompt"], "--verbose-prompt"),
    (["--no-jinja"], "with Jinja"),
    (["--reasoning-format", "auto"], "-rea off"),
    (["--warmup"], "no warmup run"),
    (["--context-shift"], "raise -c"),
    (["-o", "/nonexistent/chat.txt"], "-o/--output"),
])
def test_chat_refuses_in_one_line(tiny_pair, flags, says):
    one_line_error(chat(tiny_pair, "hi\n", *flags), says)


def test_chat_reverse_prompt_ends_the_answer_before_it(tiny_pair, decoder):
    """A stop string, as llama-cli's (llama-server's): the answer ends before it, not shown, and the
    conversation goes on with the answer as shown."""
    first = decoder.chat([{"role": "user", "content": "hi"}], n_predict=16, temperature=0).text
    stop = first[len(first) // 2:len(first) // 2 + 2]
    answer = cut_at_stop(first, [stop])
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "and then"}]
    second = cut_at_stop(decoder.chat(history, n_predict=16, temperature=0).text, [stop])
    result = chat(tiny_pair, "hi\nand then\n", "-r", stop)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{answer}\n{second}\n" and len(answer) < len(first)
    assert len(stats_lines(result.stderr)) == 2


def test_chat_first_message_single_turn_and_output_file(tiny_pair, decoder, tmp_path):
    answer = decoder.chat([{"role": "user", "content": "hi"}], n_predict=16, temperature=0).text
    log = tmp_path / "conversation.txt"
    result = chat(tiny_pair, "never read\n", "-p", "hi", "-st", "-o", str(log))
    assert result.exit_code == 0, result.output
    assert result.stdout == answer + "\n" and len(stats_lines(result.stderr)) == 1
    assert log.read_bytes().decode() == f"User:\nhi\n\nAssistant:\n{answer}\n\n"
    read = chat(tiny_pair, "hi\nnever answered\n", "-st")  # without -p: the first message read
    assert read.exit_code == 0 and read.stdout == answer + "\n"


def test_chat_multiline_input(tiny_pair, decoder):
    """-mli: a message goes on until a line ending in \\ or / (dropped); a command typed first acts at once."""
    message = "hi\nthe cat"
    answer = decoder.chat([{"role": "user", "content": message}], n_predict=16, temperature=0).text
    for ending in ("\\", "/"):
        result = chat(tiny_pair, f"/reset\nhi\nthe cat{ending}\n", "-mli")
        assert result.exit_code == 0, result.output
        assert result.stdout == answer + "\n" and "(conversation cleared)" in result.stderr
    at_end = chat(tiny_pair, "hi\nthe cat", "-mli")  # the input's end ends the message too
    assert at_end.exit_code == 0 and at_end.stdout == answer + "\n"


def test_chat_special_timings_verbose_prompt_and_simple_io(tiny_pair, decoder):
    forced = chat(tiny_pair, "hi\n", *BIAS_BOS, "-n", "3", "-sp")
    assert forced.exit_code == 0 and forced.stdout == "<s>" * 3 + "\n"
    assert chat(tiny_pair, "hi\n", *BIAS_BOS, "-n", "3").stdout == "\n"
    quiet = chat(tiny_pair, "hi\n", "--no-show-timings")
    assert quiet.exit_code == 0 and quiet.stdout and not stats_lines(quiet.stderr)
    shown = chat(tiny_pair, "hi\n", "--show-timings", "--simple-io", "--jinja", "--no-display-prompt",
                 "--reasoning-format", "none", "--no-warmup", "--no-context-shift")
    assert shown.exit_code == 0 and shown.stdout == quiet.stdout and len(stats_lines(shown.stderr)) == 1
    verbose = chat(tiny_pair, "hi\n", "--verbose-prompt")
    tokens = decoder.tokenize(decoder.render_chat([{"role": "user", "content": "hi"}]))
    assert f"number of tokens in prompt = {len(tokens)}" in verbose.stderr.splitlines()
    assert verbose.stdout == quiet.stdout
