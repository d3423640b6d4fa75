"""More of llama-completion's and llama-cli's flags on `run` and `chat` (ggufspec.cli.llamacli_more), and
--version on the commands that stand for llama.cpp's tools: the refused ones as one line before anything
loads, the values taken going on to the model, and what is honoured on the tiny pair."""
import json
import re

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from clierrors import one_line_error

# a template that shows the preserve_reasoning variable it was given, and what it derives (preserve_thinking)
TEMPLATE = ("{% if preserve_reasoning is defined %}{% if preserve_reasoning %}KEEP{% else %}DROP{% endif %}"
            "{% else %}UNSET{% endif %}{% if preserve_thinking is defined and preserve_thinking %}+{% endif %}"
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def no_model(command: str, *flags: str):
    extra = ["-p", "hi"] if command == "run" else []
    return CliRunner().invoke(main, [command, "-m", "/nonexistent.gguf", *extra, *flags], input="")


def run(tiny_pair, *flags):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-c", "256", "-t", "1",
                                     "--temp", "0", "-n", "8", *flags])


def chat(tiny_pair, *flags, stdin: str = ""):
    target, draft = tiny_pair
    return CliRunner().invoke(main, ["chat", "-m", str(target), "-md", str(draft), "-c", "256", "-t", "1",
                                     "--temp", "0", "-n", "8", "-st", *flags], input=stdin)


REFUSED_ON_BOTH = [
    (["--keep", "4"], "context shift"),
    (["--keep", "-1"], "raise -c"),
    (["-np", "2"], "ggufspec serve -np N"),
    (["--parallel", "4"], "-np/--parallel 4"),
    (["-mm", "mmproj.gguf"], "text models"),
    (["-mmu", "https://example.com/mmproj.gguf"], "images and audio"),
    (["--mmproj-auto"], "--mmproj-auto"),
    (["--mmproj-offload"], "text models"),
    (["--image-min-tokens", "64"], "text models"),
    (["--image-max-tokens", "256"], "text models"),
    (["--video-fps", "1"], "text models"),
    (["--video-timestamp-interval", "1000"], "text models"),
    (["--video-ffmpeg-dir", "/usr/bin"], "text models"),
    (["--image", "cat.png"], "--image/--audio/--video cat.png"),
    (["-cl"], "`ggufspec list`"),
    (["--cache-list"], "`ggufspec list`"),
    (["--completion-bash"], "_GGUFSPEC_COMPLETE=bash_source ggufspec"),
    (["--spec-draft-p-split", "0.2"], "never a tree"),
    (["--draft-p-split", "0.5"], "never a tree"),
]


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize("flags, says", REFUSED_ON_BOTH)
def test_refused_in_one_line_before_the_model(command, flags, says):
    line = one_line_error(no_model(command, *flags), says)
    assert "target model not found" not in line


@pytest.mark.parametrize("flags, says", [
    (["--server-base", "http://127.0.0.1:8080"], "open its chat page"),
    (["-ctxcp", "8"], "checkpoints sliding-window"),
    (["--swa-checkpoints", "8"], "leave it out"),
    (["-cram", "8192"], "KV cache"),
    (["--cache-ram", "-1"], "-cram 0 is taken"),
    (["--spec-synth-len", "3"], "ggufspec plan --trace"),
    (["--spec-synth-rates", "0.9,0.8"], "ggufspec plan --trace"),
    (["--audio", "a.wav", "--video", "v.mp4"], "a.wav,v.mp4"),
    (["-p", "hi", "-f", "message.txt"], "one of -p, -f and -bf"),
    (["-f", "/nonexistent/message.txt"], "-f/--file"),
])
def test_chat_refuses_in_one_line(flags, says):
    one_line_error(no_model("chat", *flags), says)


@pytest.mark.parametrize("flags, says", [
    (["--reasoning-preserve"], "give --chat too"),
    (["-e", "--no-escape"], "give one of them"),
    (["-bf", "prompt.bin"], "one of -p, -f and -bf"),  # -p hi is given too
])
def test_run_refuses_in_one_line(flags, says):
    one_line_error(no_model("run", *flags), says)


def test_binary_file_missing_or_no_utf8(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    for path, says in (("/nonexistent/prompt.bin", "No such file"), (str(latin1), "is not UTF-8 text (byte 0xe9)")):
        run_alone = CliRunner().invoke(main, ["run", "-m", "/nonexistent.gguf", "-bf", path])  # no -p beside it
        one_line_error(run_alone, "-bf/--binary-file", says)
        one_line_error(no_model("chat", "-bf", path), "-bf/--binary-file", says)


TAKEN_ON_BOTH = [
    ["--keep", "0", "-np", "1", "--spec-draft-p-split", "0.1", "--draft-p-split", "0.10"],
    ["--no-mmproj", "--no-mmproj-auto", "--no-mmproj-offload"],
    ["--skip-chat-parsing"], ["--no-skip-chat-parsing"],
]


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.parametrize("flags", TAKEN_ON_BOTH + [["--no-reasoning-preserve", "--chat"]])
def test_taken_values_go_on_to_the_model(command, flags):
    if command == "chat" and "--chat" in flags:
        flags = [f for f in flags if f != "--chat"]
    said = no_model(command, *flags).stderr
    assert "target model not found" in said, said


@pytest.mark.parametrize("flags", [["-cram", "0"], ["-e"], ["--no-escape"], ["--reasoning-preserve"],
                                   ["--chat-template-kwargs", '{"enable_thinking": false}', "--no-reasoning-preserve"]])
def test_chat_taken_values_go_on_to_the_model(flags):
    said = no_model("chat", *flags).stderr
    assert "target model not found" in said, said


def test_run_no_escape_is_what_run_does():
    said = no_model("run", "--no-escape").stderr
    assert "target model not found" in said, said


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_version_on_the_commands_of_llamacpps_tools(command):
    top = CliRunner().invoke(main, ["--version"])
    assert top.exit_code == 0 and top.stdout.startswith("ggufspec ")
    mine = CliRunner().invoke(main, [command, "-m", "/nonexistent.gguf", "--version"])
    assert mine.exit_code == 0 and mine.stdout == top.stdout, mine.output


def test_help_lists_what_is_honoured():
    run_help = CliRunner().invoke(main, ["run", "--help"]).output
    chat_help = CliRunner().invoke(main, ["chat", "--help"]).output
    for text in (run_help, chat_help):
        for flag in ("-bf, --binary-file", "--reasoning-preserve / --no-reasoning-preserve", "--version"):
            assert flag in text, flag
        for hidden in ("--keep", "--mmproj", "--cache-list", "--skip-chat-parsing", "--draft-p-split"):
            assert hidden not in text, hidden
    for flag in ("-f, --file", "-e, --escape / --no-escape"):
        assert flag in chat_help, flag


def test_run_binary_file_is_the_prompt_byte_for_byte(tiny_pair, tmp_path):
    """-bf: the file's bytes as they are, a CR LF and the last newline kept (-f's text mode would not)."""
    prompt = "the cat\r\nsat\n"
    path = tmp_path / "prompt.bin"
    path.write_bytes(prompt.encode())
    from_file = run(tiny_pair, "--json", "-bf", str(path))
    given = run(tiny_pair, "--json", "-p", prompt)
    assert from_file.exit_code == 0 and given.exit_code == 0, from_file.output + given.output
    assert f"Read {len(prompt)} bytes from binary file {path}" in from_file.stderr
    mine, theirs = json.loads(from_file.stdout), json.loads(given.stdout)
    assert mine["tokens"] == theirs["tokens"] and mine["stats"]["n_prompt"] == theirs["stats"]["n_prompt"]
    as_text = json.loads(run(tiny_pair, "--json", "-f", str(path)).stdout)
    assert as_text["stats"]["n_prompt"] < mine["stats"]["n_prompt"]  # -f read "\r\n" as "\n"


def test_chat_first_message_from_file_binary_file_and_escapes(tiny_pair, tmp_path):
    """-f (its last newline dropped), -bf and -e's escapes give the first message -p gives; -o shows it."""
    text_file, binary_file, log = tmp_path / "message.txt", tmp_path / "message.bin", tmp_path / "log.txt"
    text_file.write_text("hi\n")
    binary_file.write_bytes(b"hi")
    answer = chat(tiny_pair, "-p", "hi").stdout
    for flags in (["-f", str(text_file)], ["-bf", str(binary_file)], ["-e", "-p", r"h\x69"]):
        result = chat(tiny_pair, *flags, "-o", str(log), stdin="never read\n")
        assert result.exit_code == 0, result.output
        assert result.stdout == answer and log.read_text().startswith("User:\nhi\n\n"), flags
    kept = chat(tiny_pair, "--no-escape", "-p", r"h\x69", "-o", str(log))
    assert kept.exit_code == 0 and log.read_text().startswith("User:\nh\\x69\n\n")
    stop = answer.strip()[1:3]  # -e processes -r's escapes too, as llama.cpp's
    stopped = chat(tiny_pair, "-p", "hi", "-r", stop)
    written = "".join(f"\\x{ord(c):02x}" if c.isascii() else c for c in stop)
    escaped = chat(tiny_pair, "-p", "hi", "-e", "-r", written)
    assert written != stop and any(c.isascii() for c in stop)
    assert escaped.exit_code == 0 and escaped.stdout == stopped.stdout and len(stopped.stdout) < len(answer)


def prompt_text(stderr: str) -> str:
    """--verbose-prompt's token lines on chat, their pieces put back together."""
    return "".join(re.findall(r"^\s*\d+ -> '(.*)'$", stderr, re.M))


def test_reasoning_preserve_is_the_templates_variable(tiny_pair):
    """chat: on unless given (llama-cli's default); --chat-template-kwargs may turn it off, the flag is over
    it. run --chat: set only where given. preserve_thinking is derived from it."""
    said = {}
    for name, flags in (("default", []), ("off", ["--no-reasoning-preserve"]),
                        ("kwargs off", ["--chat-template-kwargs", '{"preserve_reasoning": false}']),
                        ("flag over kwargs", ["--chat-template-kwargs", '{"preserve_reasoning": false}',
                                              "--reasoning-preserve"])):
        result = chat(tiny_pair, "--chat-template", TEMPLATE, "--verbose-prompt", *flags, stdin="hi\n")
        assert result.exit_code == 0, result.output
        said[name] = prompt_text(result.stderr)
    assert "KEEP+<s>" in said["default"] and "KEEP+<s>" in said["flag over kwargs"]
    assert "DROP<s>" in said["off"] and "DROP<s>" in said["kwargs off"]
    for flags, shown in (([], "UNSET"), (["--reasoning-preserve"], "KEEP+"), (["--no-reasoning-preserve"], "DROP")):
        result = run(tiny_pair, "--chat", "-p", "hi", "--chat-template", TEMPLATE, "--display-prompt", "-sp", *flags)
        assert result.exit_code == 0, result.output
        assert f"{shown}<s>" in result.stdout.split("assistant:")[0], (flags, result.stdout)
