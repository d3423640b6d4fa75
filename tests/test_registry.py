import textwrap

import pytest

from ggufspec.registry import RegistryError, load_registry

EXPECTED_PAIRS = {"llama3-70b-q3", "codellama-7b", "deepseek-coder-6.7b", "qwen2.5-coder-7b",
                  "qwen2.5-coder-14b", "qwen2.5-coder-32b", "llama3.1-8b", "qwen2.5-coder-1.5b"}


def test_shipped_registry_parses():
    registry = load_registry()
    assert EXPECTED_PAIRS <= set(registry.pairs)
    assert registry.default == "qwen2.5-coder-1.5b"
    demo = registry.pair(None)
    assert registry.model(demo.target).sha256 and registry.model(demo.draft).pypi_parts
    seed = registry.pair("llama3-70b-q3")
    assert registry.model(seed.target).repo == "NousResearch/Meta-Llama-3-70B-Instruct-GGUF"
    assert seed.draft_k == 3


def write(home, text):
    home.mkdir(parents=True, exist_ok=True)
    (home / "models.toml").write_text(textwrap.dedent(text))


def test_user_entries_override_and_add(ggufspec_home):
    write(ggufspec_home, """
        default = "mine"
        [models."llama3-8b-instruct-q3_k_l"]
        repo = "me/other"
        file = "x.gguf"
        [pairs.mine]
        target = "llama3-70b-instruct-q3_k_s"
        draft = "llama3-8b-instruct-q3_k_l"
        draft_k = 5
    """)
    registry = load_registry()
    assert registry.model("llama3-8b-instruct-q3_k_l").repo == "me/other"
    assert registry.pair(None).draft_k == 5


@pytest.mark.parametrize("text, where", [
    ('[models.bad]\nrepo = "a/b"\nfile = "x.gguf"\nsize = "big"\n', ":4: models.bad.size"),
    ('[models.bad]\nrepo = "a/b"\nfile = "x.gguf"\ncolour = 1\n', ":4: models.bad.colour: unknown key"),
    ('[models.bad]\nfile = "x.gguf"\n', ":1: models.bad.repo: missing"),
    ('[pairs.p]\ntarget = "nope"\ndraft = "nope"\n', "not a model"),
    ('[models.bad\nrepo = 1\n', "line 1"),
    ('[models.bad]\nrepo = "a/b"\nfile = "x.gguf"\nsha256 = "xyz"\n', ":4: models.bad.sha256"),
])
def test_malformed_user_file_names_file_line_key(ggufspec_home, text, where):
    write(ggufspec_home, text)
    with pytest.raises(RegistryError) as exc:
        load_registry()
    assert where in str(exc.value)
    if "not a model" not in where:
        assert str(ggufspec_home / "models.toml") in str(exc.value)
