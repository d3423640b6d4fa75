"""llama-server's serve flags that its users copy: `--metrics` (its Prometheus endpoint under its names,
the sums of the answers' own `timings`; without the flag a 501 in OpenAI's shape, as llama-server's),
`-a/--alias` (the model's id), `--jinja` (taken: templates are always Jinja)."""
from __future__ import annotations

import re

import anthropic
import httpx
import pytest
from click.testing import CliRunner

from ggufspec.cli import main

from ggufspec.tinymodels import Shape, make_pair
from serverproc import serving


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("metrics-pair"), seed=0, shape=Shape(eos_bias=4.0))


def read_metrics(server) -> tuple[dict[str, float], httpx.Response]:
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200, response.text
    values = {}
    for line in response.text.splitlines():
        if not line.startswith("#"):
            name, value = line.split(" ")
            values[name] = float(value)
    return values, response


def test_metrics_are_the_sums_of_the_answers_timings(pair, tmp_path):
    target, draft = pair
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "--draft", "3", "--metrics") as server:
        before, response = read_metrics(server)
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert int(response.headers["Process-Start-Time-Unix"]) > 0
        assert before["llamacpp:tokens_predicted_total"] == 0 and before["llamacpp:requests_processing"] == 0
        assert re.search(r"^# TYPE llamacpp:prompt_tokens_total counter$", response.text, re.M)
        assert re.search(r"^# TYPE llamacpp:predicted_tokens_seconds gauge$", response.text, re.M)
        timings = []
        for prompt in ("one two three", "one two three four", "five six"):  # the second reuses the first's cache
            answer = httpx.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 12}, timeout=60)
            timings.append(answer.json()["timings"])
        after, _ = read_metrics(server)
    sums = {name: sum(t[name] for t in timings) for name in ("prompt_n", "cache_n", "predicted_n", "draft_n",
                                                              "draft_n_accepted")}
    assert after["llamacpp:prompt_tokens_total"] == sums["prompt_n"]
    assert after["llamacpp:prompt_tokens_cached_total"] == sums["cache_n"] > 0
    assert after["llamacpp:tokens_predicted_total"] == sums["predicted_n"] == 36
    assert after["llamacpp:spec_decode_num_draft_tokens_total"] == sums["draft_n"] > 0
    assert after["llamacpp:spec_decode_num_accepted_tokens_total"] == sums["draft_n_accepted"]
    assert 0 < after["llamacpp:spec_decode_num_drafts_total"] <= sums["draft_n"]
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:tokens_predicted_seconds_total"] > 0
    assert after["llamacpp:n_tokens_max"] >= 12


def test_the_throughput_gauges_start_again_at_each_read(pair, tmp_path):
    target, draft = pair
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "--metrics") as server:
        httpx.post(server.url + "/completion", json={"prompt": "one two", "n_predict": 8}, timeout=60)
        first, _ = read_metrics(server)
        second, _ = read_metrics(server)
    assert first["llamacpp:predicted_tokens_seconds"] > 0 and second["llamacpp:predicted_tokens_seconds"] == 0
    assert second["llamacpp:tokens_predicted_total"] == first["llamacpp:tokens_predicted_total"] == 8


def test_without_the_flag_metrics_is_a_501_in_openais_shape(pair, tmp_path):
    target, _ = pair
    with serving(tmp_path, "-m", str(target), "--no-draft") as server:
        response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 501
    error = response.json()["error"]
    assert error["type"] == "not_supported_error" and "--metrics" in error["message"]


def test_alias_names_the_model_for_both_sdks_and_the_files_names_still_work(pair, tmp_path):
    target, _ = pair
    with serving(tmp_path, "-m", str(target), "--no-draft", "-a", "coder-7b", "--jinja") as server:
        client = server.client()
        assert [model.id for model in client.models.list()] == ["coder-7b"]
        assert client.models.retrieve("coder-7b").id == "coder-7b"
        for name in ("coder-7b", target.name, target.stem):
            answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
            assert answer.model == "coder-7b"
        messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages.create(
            model="a-model-claude-code-names", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert messages.model == "coder-7b"
        assert "serving coder-7b at" in server.log.read_text()


@pytest.mark.parametrize("alias", ["", "  ", " coder", "a\nb"])
def test_a_blank_alias_is_one_line(alias):
    result = CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", "--alias", alias])
    line = result.stderr.strip()
    assert result.exit_code == 2 and line.startswith("ggufspec: error: --alias") and "\n" not in line, result.stderr
