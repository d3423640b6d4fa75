"""`OWNER/REPO:QUANT` against a Hugging Face-compatible server on 127.0.0.1 (HF_ENDPOINT): the tag names
one model exactly, as llama.cpp's -hf repo:TAG does, and a model already in the store resolves without
the hub (offline mode, or a hub that cannot be reached), as huggingface_hub and llama.cpp fall back to
their caches."""
import pytest
from click.testing import CliRunner

from ggufspec import store
from ggufspec.cli import main
from ggufspec.errors import BadReferenceError, StoreError
from hfserver import hub_for

REPO = "org/m-GGUF"
QUANTS = ("IQ4_K_M", "Q4_K_M", "Q4_K_L", "Q4_K_S")


@pytest.fixture
def hub(monkeypatch):
    with hub_for(monkeypatch) as server:
        for quant in QUANTS:
            server.state.add(REPO, f"m-{quant}.gguf", b"GGUF" + quant.encode() * 1000)
        yield server


def files(ref: str) -> tuple[str, ...]:
    return store.entry_from_reference(ref).files


@pytest.mark.parametrize("tag, file", [("Q4_K_M", "m-Q4_K_M.gguf"), ("IQ4_K_M", "m-IQ4_K_M.gguf"),
                                       ("q4_k_s", "m-Q4_K_S.gguf"), ("Q4_K_L", "m-Q4_K_L.gguf")])
def test_a_tag_names_its_own_file_not_one_that_contains_it(hub, tag, file):
    assert files(f"{REPO}:{tag}") == (file,)


def test_dotted_split_and_foldered_names_are_matched_by_their_words(hub):
    hub.state.add("org/x-GGUF", "llama-2-7b.Q5_K_M.gguf", b"GGUF")
    shards = [f"Q8_0/x-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)]
    for shard in shards:
        hub.state.add("org/x-GGUF", shard, b"GGUF")
    hub.state.add("org/x-GGUF", "mmproj-x-Q8_0.gguf", b"GGUF")  # a projector is not the model
    assert files("org/x-GGUF:Q5_K_M") == ("llama-2-7b.Q5_K_M.gguf",)
    assert files("org/x-GGUF:q8_0") == tuple(shards)


def test_a_tag_that_names_several_models_is_refused_listing_them(hub):
    with pytest.raises(BadReferenceError) as exc:
        store.entry_from_reference(f"{REPO}:Q4_K")
    message = str(exc.value)
    assert "ambiguous" in message and "\n" not in message
    assert all(f"m-{q}.gguf" in message for q in ("Q4_K_M", "Q4_K_L", "Q4_K_S")) and "IQ4" not in message
    assert f"hf://{REPO}/" in message  # how to name one
    result = CliRunner().invoke(main, ["pull", "--dry-run", f"{REPO}:Q4_K"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output


def test_a_tag_no_file_has_lists_the_quants_the_repo_has(hub):
    with pytest.raises(StoreError) as exc:
        store.entry_from_reference(f"{REPO}:Q5_K_M")
    assert "'Q5_K_M'" in str(exc.value) and "IQ4_K_M, Q4_K_L, Q4_K_M, Q4_K_S" in str(exc.value)
    assert not [r for r in hub.state.requests if "/resolve/" in r[1]]


def go_offline(how, monkeypatch):
    """The hub cannot be asked: offline mode, or nothing listens where HF_ENDPOINT points."""
    if how == "offline":
        from huggingface_hub import constants
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        import socket
        with socket.socket() as s:  # a loopback port with nothing listening: connections are refused
            s.bind(("127.0.0.1", 0))
            monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_a_pulled_quant_resolves_runs_and_is_removed_without_the_hub(hub, monkeypatch, how):
    path = store.pull(store.entry_from_reference(f"{REPO}:Q4_K_M"), progress=False)[0]
    go_offline(how, monkeypatch)
    entry = store.entry_from_reference(f"{REPO}:Q4_K_M")
    assert entry.files == ("m-Q4_K_M.gguf",) and store.is_complete(entry)
    assert store.resolve_model_arg(f"{REPO}:q4_k_m", progress=False) == str(path)
    removed = CliRunner().invoke(main, ["rm", f"{REPO}:Q4_K_M"])
    assert removed.exit_code == 0 and "removed" in removed.output, removed.output
    assert not path.exists()


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_without_the_hub_a_quant_not_in_the_store_is_the_hub_failure(hub, monkeypatch, how):
    store.pull(store.entry_from_reference(f"{REPO}:Q4_K_M"), progress=False)
    go_offline(how, monkeypatch)
    for tag in ("Q4_K_S", "IQ4_K_M"):  # IQ4_K_M: not taken for the Q4_K_M on disk either
        with pytest.raises(store.HubUnreachable, match="HF_HUB_OFFLINE|cannot reach the hub"):
            store.entry_from_reference(f"{REPO}:{tag}")
