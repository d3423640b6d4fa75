"""llama.cpp's flags for the target's logits on run and serve: --logit-bias, the penalties, --grammar,
--grammar-file, --json-schema, --json-schema-file; the same tokens as the engine's Constraints give, and one line per bad flag."""
import json

import httpx
import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.processing import Constraints
from serverproc import start_server, stop_server

GRAMMAR = 'root ::= pair+\npair ::= (" the" | " a") (" cat" | " dog" | " mat")\n'


def run(tiny_pair, *flags):
    target, draft = tiny_pair
    args = ["run", "-m", str(target), "-md", str(draft), "-p", "the cat sat", "-n", "24", "-c", "256", "-t", "1",
            "--temp", "0", "--json", *flags]
    return CliRunner().invoke(main, args)


def test_flags_give_what_the_engines_constraints_give(tiny_pair, tiny_decoder, tmp_path):
    grammar_file = tmp_path / "pairs.gbnf"
    grammar_file.write_text(GRAMMAR)
    cases = [
        (["-l", "262+5", "--logit-bias", "263-inf"], Constraints(logit_bias={262: 5.0, 263: float("-inf")})),
        (["--repeat-penalty", "1.3", "--repeat-last-n", "16", "--frequency-penalty", "0.8", "--presence-penalty", "0.5"],
         Constraints(repeat_penalty=1.3, repeat_last_n=16, frequency_penalty=0.8, presence_penalty=0.5)),
        (["--grammar", GRAMMAR], Constraints(grammar=GRAMMAR)),
        (["--grammar-file", str(grammar_file)], Constraints(grammar=GRAMMAR)),
    ]
    plain = json.loads(run(tiny_pair, "--draft", "3").stdout)["text"]
    for flags, constraints in cases:
        result = run(tiny_pair, "--draft", "3", *flags)
        assert result.exit_code == 0, result.output
        expected = tiny_decoder.generate("the cat sat", n_predict=24, n_draft=0, temperature=0, constraints=constraints)
        assert json.loads(result.stdout)["text"] == expected.text != plain, flags


def test_json_schema_flag(tiny_pair, tmp_path):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    result = run(tiny_pair, "--draft", "3", "-j", schema, "-n", "200")
    assert result.exit_code == 0, result.output
    text = json.loads(result.stdout)["text"]
    assert text.lstrip().startswith("{")  # a random tiny model may not finish the object in 200 tokens
    (tmp_path / "schema.json").write_text(schema)  # llama.cpp's -jf: the same schema from a file
    from_file = run(tiny_pair, "--draft", "3", "-jf", str(tmp_path / "schema.json"), "-n", "200")
    assert from_file.exit_code == 0 and json.loads(from_file.stdout)["text"] == text, from_file.output


def test_ignore_eos_generates_n_tokens_the_target_alones(tiny_pair, tiny_decoder):
    """llama.cpp's --ignore-eos: "a" ends at 44 tokens on the tiny pair; with it, 60, every one the target
    alone's under the same bias (greedy, drafted by the draft model: lossless)."""
    target, draft = tiny_pair
    args = ["run", "-m", str(target), "-md", str(draft), "-p", "a", "-n", "60", "-c", "256", "-t", "1", "--temp", "0",
            "--json", "--draft", "3"]
    ended = json.loads(CliRunner().invoke(main, args).stdout)
    assert ended["stats"]["stop_reason"] == "eos" and len(ended["tokens"]) < 60
    result = CliRunner().invoke(main, [*args, "--ignore-eos"])
    out = json.loads(result.stdout)
    assert out["stats"]["stop_reason"] == "n_predict" and len(out["tokens"]) == 60, result.output
    ended_ids = set(tiny_decoder.target.end_of_generation_ids)
    alone = tiny_decoder.generate("a", n_predict=60, n_draft=0, temperature=0, constraints=Constraints(ignore_eos=True))
    assert out["tokens"] == alone.tokens and not ended_ids & set(alone.tokens)


@pytest.mark.parametrize("flags, says", [
    (["--logit-bias", "abc"], "--logit-bias takes TOKEN_ID(+/-)BIAS"),
    (["--frequency-penalty", "5"], "frequency_penalty must be in [-2, 2]"),
    (["--json-schema", "{not json"], "--json-schema is not valid JSON"),
    (["--grammar", "root ::= x", "--json-schema", "{}"], "choose one of --grammar, --json-schema"),
    (["-j", "{}", "-jf", __file__], "choose one of --json-schema, --json-schema-file"),
    (["--json-schema-file", __file__], "--json-schema-file is not valid JSON"),
    (["--grammar", "root ::= (unclosed"], "the grammar does not parse"),
])
def test_bad_flags_are_one_line(tiny_pair, flags, says):
    result = run(tiny_pair, *flags)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output


def test_serve_flags_are_request_defaults(tiny_pair, tiny_decoder, tmp_path):
    """--logit-bias on serve applies to every request; a request's own fields go on top of it."""
    target, draft = tiny_pair
    running = start_server(tmp_path, "-m", str(target), "-md", str(draft), "-c", "256", "--logit-bias", "262+5")
    try:
        assert httpx.get(running.url + "/props", timeout=10).status_code == 200
        assert httpx.get(running.url + "/v1/models", timeout=10).status_code == 200
        client = running.client()
        answer = client.completions.create(model="target", prompt="the cat sat", max_tokens=16, temperature=0)
        expected = tiny_decoder.generate("the cat sat", n_predict=16, n_draft=0, temperature=0,
                                         constraints=Constraints(logit_bias={262: 5.0}))
        assert answer.choices[0].text == expected.text
        both = client.completions.create(model="target", prompt="the cat sat", max_tokens=16, temperature=0,
                                         frequency_penalty=1.0)
        expected = tiny_decoder.generate("the cat sat", n_predict=16, n_draft=0, temperature=0,
                                         constraints=Constraints(logit_bias={262: 5.0}, frequency_penalty=1.0))
        assert both.choices[0].text == expected.text
    finally:
        stop_server(running)
