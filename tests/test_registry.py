import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ggufspec.registry import RegistryError, load_registry, shipped_registry_path

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


# ---------------------------------------------------------------- where the shipped registry lives

REPO = Path(__file__).resolve().parent.parent


def test_checkout_reads_the_top_level_registry():
    """The registry is models.toml next to pyproject.toml; the source package holds no copy of it."""
    assert shipped_registry_path() == REPO / "models.toml"
    assert not (REPO / "ggufspec" / "models.toml").exists()


def test_wheel_ships_the_registry_and_the_installed_package_finds_it(tmp_path):
    """Build the wheel from a copy of the sources (the checkout stays clean), then load the registry
    from the unpacked wheel in a fresh interpreter, as an installed package would."""
    source = tmp_path / "src"
    shutil.copytree(REPO / "ggufspec", source / "ggufspec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "models.toml"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            str(source), "-w", str(tmp_path / "dist")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    assert "Deprecat" not in build.stderr and "Editable" not in build.stderr, build.stderr
    wheel = next((tmp_path / "dist").glob("ggufspec-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("ggufspec/models.toml") == (REPO / "models.toml").read_bytes()
        zf.extractall(tmp_path / "site")
    probe = ("import ggufspec.registry as r, json; reg = r.load_registry(); "
             "print(json.dumps([str(r.shipped_registry_path()), sorted(reg.pairs)]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    path, pairs = json.loads(found.stdout)
    assert path == str(tmp_path / "site" / "ggufspec" / "models.toml")
    assert EXPECTED_PAIRS <= set(pairs)


def test_a_models_toml_that_is_not_utf8_is_one_line(ggufspec_home):
    ggufspec_home.mkdir(parents=True, exist_ok=True)
    (ggufspec_home / "models.toml").write_bytes("[models]\n".encode("utf-16"))  # Notepad's "Unicode"
    with pytest.raises(RegistryError, match="not UTF-8 text; save it as UTF-8"):
        load_registry()
