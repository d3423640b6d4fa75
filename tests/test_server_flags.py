"""llama-server's serve flags that its users copy: `--metrics` (its Prometheus endpoint under its names,
the sums of the answers' own `timings`; without the flag a 501 in OpenAI's shape, as llama-server's),
`-a/--alias` (the model's id), `--jinja` (taken: templates are always Jinja), `--ssl-key-file` and
`--ssl-cert-file` (HTTPS)."""
from __future__ import annotations

import re
import shutil
import ssl
import subprocess

import anthropic
import httpx
import openai
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


# ---------------------------------------------------------------- --ssl-key-file / --ssl-cert-file

@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, and its key (openssl, as a user makes one)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate with")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem"), "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return folder / "key.pem", folder / "cert.pem"


def test_https_with_the_key_and_certificate_and_the_sdks_trusting_it(pair, tmp_path, certificate):
    target, draft = pair
    key, cert = certificate
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "--ssl-key-file", str(key),
                 "--ssl-cert-file", str(cert), "--api-key", "sekrit") as server:
        assert server.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(server.url + "/health", verify=trusting, timeout=10).json()["status"] == "ok"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0,
                               http_client=httpx.Client(verify=trusting, timeout=60))
        answer = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert answer.choices[0].message.content is not None
        with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer from a TLS port
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust the certificate
            httpx.get(server.url + "/health", timeout=5)


@pytest.mark.parametrize("which, words", [
    ("key only", "give both --ssl-key-file and --ssl-cert-file"),
    ("missing", "No such file"),
    ("swapped", "are not a PEM certificate and its unencrypted private key"),
])
def test_bad_tls_files_are_one_line_before_anything_loads(certificate, tmp_path, which, words):
    key, cert = certificate
    flags = {"key only": ["--ssl-key-file", str(key)],
             "missing": ["--ssl-key-file", str(tmp_path / "none.pem"), "--ssl-cert-file", str(cert)],
             "swapped": ["--ssl-key-file", str(cert), "--ssl-cert-file", str(key)]}[which]
    result = CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", *flags])
    line = result.stderr.strip()
    assert result.exit_code == 2 and words in line and "\n" not in line, result.stderr


def test_https_through_serve_rpcs_supervisor(needs_rpc, pair, tmp_path, certificate):
    """With --rpc the front (the supervisor) speaks HTTPS; the model process behind it, plain on its socket."""
    from rpcworkers import Worker
    target, draft = pair
    key, cert = certificate
    (tmp_path / "worker").mkdir()
    worker = Worker(tmp_path / "worker")
    try:
        with serving(tmp_path, "-m", str(target), "-md", str(draft), "--rpc", str(worker.endpoint),
                     "--ssl-key-file", str(key), "--ssl-cert-file", str(cert)) as server:
            assert server.url.startswith("https://")
            trusting = ssl.create_default_context(cafile=str(cert))
            answer = httpx.post(server.url + "/completion", json={"prompt": "one two", "n_predict": 4},
                                verify=trusting, timeout=60)
            assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 4
    finally:
        worker.stop()


# ---------------------------------------------------------------- --chat-template / --chat-template-file

CUSTOM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_a_chat_template_file_is_rendered_instead_of_the_models_own(pair, tmp_path):
    target, draft = pair
    template = tmp_path / "template.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "--chat-template-file", str(template)) as server:
        prompt = httpx.post(server.url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]},
                            timeout=30).json()["prompt"]
        assert prompt == "[USER] hi\n[ASSISTANT]"
        props = httpx.get(server.url + "/props", timeout=10).json()
        assert props["chat_template"] == CUSTOM_TEMPLATE and not props["chat_template_fallback"]
        answer = server.client().chat.completions.create(model="target", max_tokens=3,
                                                         messages=[{"role": "user", "content": "hi"}])
        assert answer.usage.prompt_tokens > 0


def test_chatml_by_name_in_the_python_api(pair):
    from ggufspec.load import DEFAULT_CHAT_TEMPLATE
    from ggufspec.session import ModelOptions, open_session
    target, draft = pair
    with open_session(ModelOptions(model=str(target), model_draft=str(draft), chat_template="chatml",
                                   n_ctx=256, n_threads=1), log=lambda line: None) as session:
        prompt = session.decoder.render_chat([{"role": "user", "content": "hi"}])
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert session.decoder.target_llm.metadata["tokenizer.chat_template"] == DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize("flags, words", [
    (["--chat-template", "llama3"], "no Jinja template, and of llama.cpp's built-in template names"),
    (["--chat-template", "{% for m in messages %}"], "not a Jinja template (line 1"),
    (["--chat-template", "x", "--chat-template-file", "/t.jinja"], "not both"),
    (["--chat-template-file", "/nonexistent/t.jinja"], "No such file"),
])
def test_bad_chat_templates_are_one_line_before_the_models_load(pair, flags, words):
    target, _ = pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "--no-draft", "-p", "x", "-n", "2", *flags])
    line = result.stderr.strip()
    assert result.exit_code == 2 and words in line and "\n" not in line, result.stderr
