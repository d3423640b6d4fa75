"""llama.cpp's model-download flags (-hf, -hff, -hfd, -hft, -mu, --offline, -dr) on run, chat, serve, bench
and eval, against a Hugging Face-compatible server on 127.0.0.1 (HF_ENDPOINT) and a plain HTTP server for
-mu: nothing is mocked. A model fetched by a flag is the same file -m takes, and generates the same text."""
import functools
import json
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from click.testing import CliRunner

from clierrors import one_line_error
from ggufspec import store
from ggufspec.cli import main
from hfserver import HubServer
from serverproc import serving

REPO, DRAFT_REPO = "org/tiny-GGUF", "org/tiny-draft-GGUF"
pytestmark = pytest.mark.usefixtures("hub_settings_restored")


@pytest.fixture
def hub_files(tiny_pair):
    """What conftest's `hub` holds: the tiny pair, under llama.cpp-style repository and quant names."""
    target, draft = (path.read_bytes() for path in tiny_pair)
    return {(REPO, "tiny-Q4_K_M.gguf"): target, (REPO, "tiny-Q8_0.gguf"): target,
            (REPO, "mmproj-tiny-F16.gguf"): b"GGUF projector", (DRAFT_REPO, "tiny-draft-Q8_0.gguf"): draft}


@pytest.fixture
def web(tmp_path, tiny_pair):
    """A plain HTTP server (http.server) serving the tiny target as /models/tiny.gguf; it notes each
    request's Authorization header."""
    folder = tmp_path / "web"
    (folder / "models").mkdir(parents=True)
    (folder / "models" / "tiny.gguf").write_bytes(tiny_pair[0].read_bytes())
    seen = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_head(self):
            seen.append(self.headers.get("Authorization"))
            return super().send_head()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url, server.authorizations = f"http://127.0.0.1:{server.server_address[1]}", seen
    yield server
    server.shutdown()
    server.server_close()


def run(*flags):
    return CliRunner().invoke(main, ["run", "-n", "8", "-c", "128", "-t", "1", "--temp", "0", "--json",
                                     "-p", "the cat", *flags])


def tokens(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


def resolve_requests(hub) -> list[str]:
    return [path for _, path, _ in hub.state.requests if "/resolve/" in path]


# ---------------------------------------------------------------- -hf, -hff, -hfd

def test_hf_generates_what_m_of_the_same_file_does(hub, tiny_pair):
    target, draft = tiny_pair
    fetched = run("-hf", f"{REPO}:q4_k_m", "-md", str(draft))
    path = store.final_path(store.entry_from_reference(f"hf://{REPO}/tiny-Q4_K_M.gguf"), "tiny-Q4_K_M.gguf")
    assert path.read_bytes() == target.read_bytes()
    assert tokens(fetched) == tokens(run("-m", str(target), "-md", str(draft))) != []
    assert resolve_requests(hub) and all("Q4_K_M" in p for p in resolve_requests(hub))  # the one file named


def test_hff_names_the_file_and_overrides_the_quant(hub, tiny_pair):
    result = run("-hf", f"{REPO}:Q4_K_M", "-hff", "tiny-Q8_0.gguf", "--no-draft")
    assert tokens(result)
    assert resolve_requests(hub) and all("tiny-Q8_0.gguf" in p for p in resolve_requests(hub))


@pytest.mark.parametrize("files, taken", [
    (["m-IQ4_XS.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-F16.gguf"], "m-Q4_K_M.gguf"),
    (["m-IQ4_XS.gguf", "m-Q8_0.gguf", "m-F16.gguf"], "m-Q8_0.gguf"),
    (["imatrix-a.gguf", "mmproj-a.gguf", "b-F16.gguf", "c-F32.gguf", "README.md"], "b-F16.gguf"),
])
def test_hf_without_a_quant_takes_llamacpps_default(hub, files, taken):
    for name in files:
        hub.state.add("org/d-GGUF", name, b"GGUF")
    assert store.entry_from_reference("hf://org/d-GGUF").files == (taken,)


def test_hfd_fetches_the_draft_from_the_hub(hub, tiny_pair):
    target, draft = tiny_pair
    by_tag = run("-m", str(target), "-hfd", f"{DRAFT_REPO}:Q8_0")
    stored = store.final_path(store.entry_from_reference(f"hf://{DRAFT_REPO}/tiny-draft-Q8_0.gguf"),
                              "tiny-draft-Q8_0.gguf")
    assert json.loads(by_tag.stdout)["draft_choice"]["path"] == str(stored), by_tag.output
    by_file = run("-m", str(target), "-hfd", DRAFT_REPO, "-md", "tiny-draft-Q8_0.gguf")  # -md: the file in it
    assert tokens(by_tag) == tokens(by_file) == tokens(run("-m", str(target), "-md", str(draft)))


# ---------------------------------------------------------------- --offline

def test_offline_without_the_file_names_the_pull_and_asks_nothing(hub):
    line = one_line_error(run("--offline", "-hf", f"{REPO}:Q4_K_M"), "ggufspec pull org/tiny-GGUF:Q4_K_M",
                          "offline", code=1)
    assert "Traceback" not in line and hub.state.requests == []
    one_line_error(run("--offline", "-hf", REPO), f"ggufspec pull hf://{REPO}", code=1)


def test_offline_with_the_file_stored_runs_from_the_store(hub, tiny_pair):
    online = tokens(run("-hf", f"{REPO}:Q4_K_M", "--no-draft"))
    hub.state.requests.clear()
    assert tokens(run("--offline", "-hf", f"{REPO}:Q4_K_M", "--no-draft")) == online
    assert tokens(run("--offline", "-hf", REPO, "--no-draft")) == online  # the default among what is stored
    assert hub.state.requests == []


# ---------------------------------------------------------------- one-line failures

def test_a_missing_quant_or_repository_is_one_line(hub):
    one_line_error(run("-hf", f"{REPO}:Q2_K"), "'Q2_K'", "Q4_K_M, Q8_0", code=1)
    one_line_error(run("-hf", "org/absent-GGUF:Q4_K_M"), "repository not found", code=1)
    one_line_error(run("-hf", REPO, "-hff", "absent.gguf"), "file not found", code=1)


def test_an_unreachable_hub_is_one_line(monkeypatch):
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        one_line_error(run("-hf", f"{REPO}:Q4_K_M"), "cannot reach the hub", code=1)


@pytest.mark.parametrize("flags, words", [
    (["-m", "x.gguf", "-hf", REPO], ["-m and -hf"]),
    (["-hf", REPO, "-mu", "http://127.0.0.1:1/a.gguf"], ["-hf and -mu"]),
    (["-hff", "a.gguf"], ["-hff", "-hf"]),
    (["tiny", "-hf", REPO], ["PAIR", "-hf"]),
    (["-hfd", DRAFT_REPO], ["-hfd", "target"]),
    (["-m", "x.gguf", "-hfd", DRAFT_REPO, "-md", "mtp"], ["mtp", "-hfd"]),
    (["-hf", "justaname"], ["-hf justaname", "<user>/<model>[:quant]"]),
    (["-hf", f"{REPO}:Q4 K"], ["quant"]),
    (["-hf", REPO, "-hff", "notes.txt"], ["-hff notes.txt", ".gguf"]),
    (["-hf", REPO, "-hff", "../up.gguf"], ["-hff ../up.gguf", "'..'"]),
    (["-hft", " ", "-hf", REPO], ["-hft is empty"]),
    (["-mu", "ftp://127.0.0.1/a.gguf"], ["-mu", "http(s)://"]),
    (["-mu", "http://127.0.0.1:1/download"], ["-mu", "not a .gguf file name"]),
    (["-mu", "http://127.0.0.1:1/a%2F..%2Fb.gguf"], ["-mu", "refused"]),
    (["-dr", "gemma3"], ["-dr/--docker-repo", "-hf", "-mu"]),
])
def test_bad_or_contradictory_flags_are_one_line(flags, words):
    one_line_error(run(*flags), *words)


@pytest.mark.parametrize("command", [["chat"], ["serve"], ["bench"], ["eval", "humaneval"]])
def test_every_command_takes_them(command):
    result = CliRunner().invoke(main, [*command, "-m", "x.gguf", "-hf", REPO], input="")
    one_line_error(result, "-m and -hf")
    one_line_error(CliRunner().invoke(main, [*command, "-dr", "gemma3"], input=""), "-dr/--docker-repo")


# ---------------------------------------------------------------- -mu

def test_mu_downloads_into_the_store_and_runs_it_offline_after(web, tiny_pair, monkeypatch):
    target, draft = tiny_pair
    url = f"{web.url}/models/tiny.gguf"
    fetched = tokens(run("-mu", url, "-md", str(draft), "-hft", "secret"))
    assert fetched == tokens(run("-m", str(target), "-md", str(draft)))
    path = store.final_path(store.entry_from_reference(url), "tiny.gguf")
    assert path.read_bytes() == target.read_bytes()
    assert web.authorizations and set(web.authorizations) == {None}  # the hub's token goes to the hub only
    web.authorizations.clear()
    assert tokens(run("--offline", "-mu", url, "-md", str(draft))) == fetched and web.authorizations == []
    listed = CliRunner().invoke(main, ["list", "--json"])
    assert str(path) in json.loads(listed.stdout)["other_models"]  # by its path: no hf:// reference names it


def test_mu_offline_without_the_file_names_the_pull(web):
    one_line_error(run("--offline", "-mu", f"{web.url}/models/tiny.gguf"), "ggufspec pull http://", code=1)
    assert web.authorizations == []


def test_mu_missing_file_or_server_is_one_line(web, monkeypatch):
    one_line_error(run("-mu", f"{web.url}/models/absent.gguf"), "HTTP 404", code=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        one_line_error(run("-mu", f"http://127.0.0.1:{s.getsockname()[1]}/a.gguf"), "cannot reach", code=1)


def test_a_url_download_cut_short_is_resumed_and_checked(monkeypatch):
    """A URL's file as the store pulls any other: a cut transfer resumed by the next pull; a page that
    is no GGUF file deleted. (HubServer answers Range requests, which http.server does not.)"""
    data = b"GGUF" + bytes(range(256)) * 12_000  # 3 MB: the store writes what arrived by the MiB
    with HubServer() as server:
        server.state.add("web/files", "big.gguf", data)
        server.state.add("web/files", "page.gguf", b"<html>login</html>")
        server.state.unhashed.update({"big.gguf", "page.gguf"})  # a plain server: no sha256 announced
        server.state.cut_at["big.gguf"] = 2_500_000
        url = f"{server.url}/web/files/resolve/main/big.gguf"
        result = CliRunner().invoke(main, ["pull", "-q", url])
        assert result.exit_code == 1 and "run pull again" in result.stderr, result.output
        del server.state.cut_at["big.gguf"]
        assert CliRunner().invoke(main, ["pull", "-q", url]).exit_code == 0
        assert store.resolve_model_arg(url, progress=False).endswith("big.gguf")
        ranges = [r for method, _, r in server.state.requests if method == "GET" and r]
        assert ranges and int(ranges[-1][len("bytes="):].rstrip("-")) > 0  # resumed, not started again
        entry = store.entry_from_reference(url)
        assert store.final_path(entry, "big.gguf").read_bytes() == data
        page = CliRunner().invoke(main, ["pull", "-q", url.replace("big", "page")])
        one_line_error(page, "sent no GGUF file", code=1)


# ---------------------------------------------------------------- the token

def test_the_token_reaches_the_hub(hub, monkeypatch):
    assert tokens(run("-hf", f"{REPO}:Q4_K_M", "--no-draft", "-hft", "hf_flag"))
    assert set(hub.state.authorizations) == {"Bearer hf_flag"}
    hub.state.authorizations.clear()
    monkeypatch.setenv("HF_TOKEN", "hf_env")  # the default, as huggingface_hub's
    store.remove(store.entry_from_reference(f"hf://{REPO}/tiny-Q4_K_M.gguf"))
    assert tokens(run("-hf", f"{REPO}:Q4_K_M", "--no-draft"))
    assert set(hub.state.authorizations) == {"Bearer hf_env"}


# ---------------------------------------------------------------- serve

def test_serve_hf_names_the_model_as_llama_server_does(hub, tmp_path, tiny_pair):
    with serving(tmp_path, "-hf", f"{REPO}:Q4_K_M", "-md", str(tiny_pair[1]), "--no-warmup", "-c", "256") as server:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [f"{REPO}:Q4_K_M"]
        answer = server.client().completions.create(model=f"{REPO}:Q4_K_M", prompt="the cat", max_tokens=4,
                                                    temperature=0)
        assert answer.choices[0].text is not None
