"""llama-server's other names for routes (/v1/health, /models, /responses for a base URL without /v1),
OpenAI's input-token count for the Responses API (`client.responses.input_tokens.count`), and serve's
--tags and -r. A real server on loopback, the official clients."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from serverproc import pair_server_fixture

KEY = "k-alias"
AUTH = {"Authorization": f"Bearer {KEY}"}


server = pair_server_fixture("--api-key", KEY, "--temp", "0", "--tags", "tiny, test,", "-r", "FY")


def test_v1_health_is_open_as_health(server):
    assert httpx.get(server.url + "/v1/health", timeout=10).json()["status"] == "ok"  # no key, as /health


def test_the_models_tags_and_aliases(server):
    """llama-server's `tags` (--tags, informational) and `aliases` (the other names a request may use)."""
    [entry] = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert entry["id"] == "target" and entry["tags"] == ["tiny", "test"] and "target.gguf" in entry["aliases"]
    assert entry["id"] not in entry["aliases"]


def test_models_without_v1(server):
    assert httpx.get(server.url + "/models", headers=AUTH).json() == httpx.get(server.url + "/v1/models",
                                                                               headers=AUTH).json()
    assert httpx.get(server.url + "/models").status_code == 401


def test_responses_for_a_base_url_without_v1(server):
    bare = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    versioned = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    asked = dict(model="target", input="one two", max_output_tokens=8, temperature=0)
    assert bare.responses.create(**asked).output_text == versioned.responses.create(**asked).output_text


@pytest.mark.parametrize("base", ["/v1", ""])
def test_input_tokens_counts_the_rendered_input(server, base):
    client = openai.OpenAI(base_url=server.url + base, api_key=KEY, max_retries=0)
    counted = client.responses.input_tokens.count(model="target", instructions="be brief", input="one two three")
    assert counted.object == "response.input_tokens"
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    same = claude.messages.count_tokens(model="target", system="be brief",
                                        messages=[{"role": "user", "content": "one two three"}])
    assert counted.input_tokens == same.input_tokens > 3
    longer = client.responses.input_tokens.count(instructions="be brief", input="one two three four five six")
    assert longer.input_tokens > counted.input_tokens


def test_input_tokens_refuses_what_responses_refuses(server):
    for body, words in (({"input": []}, "input"), ({"input": "x", "previous_response_id": "r1"}, "stateless"),
                        ({"input": "x", "model": "other"}, "is not served here")):
        response = httpx.post(server.url + "/v1/responses/input_tokens", json=body, headers=AUTH, timeout=10)
        assert response.status_code in (400, 404) and words in response.json()["error"]["message"], response.text
    assert httpx.post(server.url + "/v1/responses/input_tokens", json={"input": "x"}).status_code == 401


def test_serve_r_is_the_stop_of_a_request_that_gives_none(server):
    """llama-server's -r: the stop strings of every request without its own (the tiny model writes "FY")."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    asked = dict(model="target", prompt="one two three", max_tokens=24, temperature=0)
    whole = client.completions.create(**asked, stop=["\x01"]).choices[0]  # its own stop: -r not applied
    assert "FY" in whole.text
    cut = client.completions.create(**asked).choices[0]
    assert cut.text == whole.text[:whole.text.index("FY")] and cut.finish_reason == "stop"
