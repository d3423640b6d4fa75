"""FILENAME.setup beside a slot file (`ggufspec.server.slotsetup`): the setup whose KV cells the file
holds. A restore on a server whose target computes other cells (another LoRA scale, a control vector)
is a 400 naming the difference and leaves the slot as it was; the same setup restores, across what
only rounds the cells (threads, another draft cache type); a file without a sidecar (llama-server's)
restores unchecked and says so; names that are, or would collide with, a sidecar are refused.
Four servers of the tiny pair on loopback, sharing one --slot-save-path; raw HTTP."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ggufspec.server import slotsetup
from ggufspec.tinymodels import Shape, write_lora
from serverproc import start_server, stop_server
from test_control_vectors import direction, write_vector

PROMPT = "one two three four five six seven eight nine ten"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("setup-files")
    (folder / "saves").mkdir()
    return {"saves": folder / "saves", "lora": write_lora(folder / "one.gguf", Shape(eos_bias=4.0), seed=1),
            "vector": write_vector(folder / "vec.gguf", {1: direction(1)})}


@pytest.fixture(scope="module")
def servers(tiny_pair, files, tmp_path_factory):
    """half: the adapter at 0.5 (where the files are saved); again: the same, with other threads and
    another draft cache type; quarter: the adapter at 0.25; steered: at 0.5 with a control vector."""
    target, draft = tiny_pair
    common = ["-m", str(target), "-md", str(draft), "--draft", "3", "-c", "256", "-np", "2", "--temp", "0",
              "--slot-save-path", str(files["saves"])]
    half = ["--lora-scaled", f"{files['lora']}:0.5"]
    flags = {"half": half, "again": [*half, "-t", "2", "-ctkd", "f32"],
             "quarter": ["--lora-scaled", f"{files['lora']}:0.25"],
             "steered": [*half, "--control-vector", str(files["vector"])]}
    with ThreadPoolExecutor(len(flags)) as pool:  # the starts overlap
        started = {name: pool.submit(start_server, tmp_path_factory.mktemp(name), *common, *extra)
                   for name, extra in flags.items()}
        running = {name: future.result() for name, future in started.items()}
    try:
        yield running
    finally:
        for server in running.values():
            stop_server(server)


def completion(server, prompt: str = PROMPT) -> dict:
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0}
    answer = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def slot_post(server, id_slot: int, action: str, filename: str | None = None) -> httpx.Response:
    body = None if filename is None else {"filename": filename}
    return httpx.post(server.url + f"/slots/{id_slot}?action={action}", json=body, timeout=60)


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "filename"
    assert "\n" not in error["message"]
    return error


def cached(server) -> list[int]:
    return [s["n_cached"] for s in httpx.get(server.url + "/slots", timeout=10).json()]


@pytest.fixture(scope="module")
def saved(servers, files):
    """A conversation of `half`'s saved to conv.bin: its answer and the save's."""
    half = servers["half"]
    first = completion(half)
    answer = slot_post(half, first["id_slot"], "save", "conv.bin")
    assert answer.status_code == 200, answer.text
    return {"first": first, "save": answer.json()}


def test_the_save_writes_its_setup_beside_a_file_llama_server_reads(saved, files, tiny_pair):
    saves, n_saved = files["saves"], saved["save"]["n_saved"]
    assert saved["save"]["n_written"] == (saves / "conv.bin").stat().st_size  # the file itself as before
    assert (saves / "conv.bin").read_bytes()[12:24] == \
        b"\xff\xff\xff\xff\x01\x00\x00\x00" + n_saved.to_bytes(4, "little")  # llama-server's token layout
    sidecar = json.loads((saves / "conv.bin.setup").read_text())
    target = sidecar["target"]
    assert sidecar["format"] == "ggufspec slot setup" and sidecar["fingerprint"] == slotsetup.fingerprint(target)
    assert target["file"] == [tiny_pair[0].name, tiny_pair[0].stat().st_size]
    assert target["lora"] == [["one.gguf", files["lora"].stat().st_size, 0.5]]
    assert target["cache_types"] == ["f16", "f16"]
    assert "cvec" not in target and sidecar["draft"]["file"][0] == tiny_pair[1].name
    assert sidecar["flags"] == f"-m {tiny_pair[0].name} -ctk f16 -ctv f16 --lora-scaled one.gguf:0.5"
    assert sorted(p.name for p in saves.iterdir() if p.name.startswith("conv.bin")) == \
        ["conv.bin", "conv.bin.draft", "conv.bin.setup"]  # no temporary file left


def test_the_same_setup_restores_and_the_next_prompt_reuses_it(servers, saved):
    half, first = servers["half"], saved["first"]
    for id_slot in (0, 1):
        slot_post(half, id_slot, "erase")
    restored = slot_post(half, 1, "restore", "conv.bin").json()
    assert (restored["n_restored"], restored["setup_checked"]) == (saved["save"]["n_saved"], True)
    assert restored["n_restored_draft"] == saved["save"]["n_saved_draft"] > 0
    again = completion(half)
    assert again["id_slot"] == 1 and again["timings"]["cache_n"] >= again["tokens_evaluated"] - 1 > 0
    assert again["content"] == first["content"]


def test_what_only_rounds_the_cells_is_no_difference(servers, saved):
    """Other threads: another system_fingerprint, the same cells' setup; the draft's other cache type
    passes its file over (it catches up), the target's restores."""
    half, again = servers["half"], servers["again"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    prints = [httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60).json()["system_fingerprint"]
              for s in (half, again)]
    assert prints[0] != prints[1]
    restored = slot_post(again, 0, "restore", "conv.bin").json()
    assert (restored["n_restored"], restored["setup_checked"], restored["n_restored_draft"]) == \
        (saved["save"]["n_saved"], True, 0)
    assert completion(again)["timings"]["cache_n"] > 0


def test_another_lora_scale_is_refused_and_the_slot_left_as_it_was(servers, saved):
    quarter = servers["quarter"]
    before = completion(quarter, "the cat sat on the mat")
    n_cached = cached(quarter)
    message = error_of(slot_post(quarter, before["id_slot"], "restore", "conv.bin"))["message"]
    assert "saved with --lora-scaled one.gguf:0.5, this server has --lora-scaled one.gguf:0.25" in message
    assert "conv.bin.setup" in message
    assert cached(quarter) == n_cached
    again = completion(quarter, "the cat sat on the mat")  # what the slot held is still there
    assert again["id_slot"] == before["id_slot"] and again["timings"]["cache_n"] >= again["tokens_evaluated"] - 1 > 0
    assert again["content"] == before["content"]


def test_a_control_vector_difference_is_refused(servers, saved):
    steered = servers["steered"]
    message = error_of(slot_post(steered, 1, "restore", "conv.bin"))["message"]
    assert "saved with none, this server has --control-vector vec.gguf --control-vector-layer-range" in message
    assert "lora" not in message  # the same adapter and scale: not named
    assert cached(steered) == [0, 0]


def test_a_file_without_a_setup_restores_unchecked(servers, saved, files):
    """llama-server's files (and those saved before the sidecar) restore as they did, saying so."""
    saves, quarter = files["saves"], servers["quarter"]
    shutil.copy(saves / "conv.bin", saves / "bare.bin")
    restored = slot_post(quarter, 1, "restore", "bare.bin").json()
    assert (restored["n_restored"], restored["setup_checked"]) == (saved["save"]["n_saved"], False)
    erased = slot_post(quarter, 1, "erase").json()
    assert erased["n_erased"] == saved["save"]["n_saved"] and (saves / "bare.bin").exists()  # nothing removed


def test_sidecar_names_are_not_saved_to_and_a_foreign_one_is_not_overwritten(servers, saved, files):
    saves, half = files["saves"], servers["half"]
    before = sorted(p.name for p in saves.iterdir())
    for name in ("x.setup", "x.draft", "a" * 250):
        assert "Invalid filename" in error_of(slot_post(half, 0, "save", name))["message"]
    assert sorted(p.name for p in saves.iterdir()) == before
    # a slot file a user named keep.setup (llama-server saves any name): "keep" is not saved over it
    shutil.copy(saves / "conv.bin", saves / "keep.setup")
    message = error_of(slot_post(half, 0, "save", "keep"))["message"]
    assert "keep.setup in --slot-save-path is not ggufspec's setup file" in message and not (saves / "keep").exists()
    assert (saves / "keep.setup").read_bytes() == (saves / "conv.bin").read_bytes()
    assert slot_post(half, 1, "restore", "keep.setup").json()["setup_checked"] is False  # still a slot file
    sidecar = error_of(slot_post(half, 0, "restore", "conv.bin.setup"))
    assert "is the setup of the slot file conv.bin" in sidecar["message"]
    longest = "b" * 249  # its .setup is 255 bytes, the most a name may have
    assert slot_post(half, 0, "save", longest).status_code == 200 and (saves / (longest + ".setup")).exists()


def test_a_save_over_an_earlier_one_replaces_its_setup(servers, files):
    """The quarter server saves over a file the half one saved: the sidecar is the new setup's."""
    saves, quarter = files["saves"], servers["quarter"]
    for server in (servers["half"], quarter):
        id_slot = completion(server, "seven eight nine")["id_slot"]
        assert slot_post(server, id_slot, "save", "shared.bin").status_code == 200
    assert json.loads((saves / "shared.bin.setup").read_text())["target"]["lora"][0][2] == 0.25
    assert slot_post(quarter, 1, "restore", "shared.bin").json()["setup_checked"] is True
    refused = error_of(slot_post(servers["half"], 1, "restore", "shared.bin"))
    assert "this server has --lora-scaled one.gguf:0.5" in refused["message"]


# ---------------------------------------------------------------- the differences named

TARGET = {"file": ["t.gguf", 100], "cache_types": ["f16", "f16"]}


@pytest.mark.parametrize("saved, here, named", [
    ({**TARGET, "lora": [["a.gguf", 9, 0.5]]}, TARGET, "saved with --lora-scaled a.gguf:0.5, this server has none"),
    ({**TARGET, "lora": [["a.gguf", 9, 1.0]]}, {**TARGET, "lora": [["a.gguf", 8, 1.0]]},
     "saved with --lora a.gguf (9 bytes), this server has --lora a.gguf (8 bytes)"),
    ({**TARGET, "file": ["t.gguf", 101]}, TARGET,
     "saved with -m t.gguf (101 bytes), this server has -m t.gguf (100 bytes)"),
    ({**TARGET, "cache_types": ["q8_0", "f16"]}, TARGET,
     "saved with -ctk q8_0 -ctv f16, this server has -ctk f16 -ctv f16"),
    ({**TARGET, "cvec": [[["v.gguf", 5, 0.8]], 1, 3]}, TARGET,
     "saved with --control-vector-scaled v.gguf:0.8 --control-vector-layer-range 1 3, this server has none"),
    (TARGET, {**TARGET, "rope": {"rope_scaling_type": "yarn", "rope_freq_base": 20000.0}},
     "saved with none, this server has --rope-scaling yarn --rope-freq-base 20000"),
    ({**TARGET, "override_kv": {"a.b": False, "c": 3, "d": "x"}}, TARGET,
     "saved with --override-kv a.b=bool:false --override-kv c=int:3 --override-kv d=str:x, this server has none"),
    ({**TARGET, "lora": "edited"}, TARGET, 'saved with lora "edited", this server has none'),
])
def test_the_differences_are_named_as_flags(saved, here, named):
    assert slotsetup.differences(saved, here) == [named]


def test_the_fingerprint_counts_rope_and_metadata_overrides(tiny_pair):
    """RoPE/YaRN settings and --override-kv change the target's cells: they are in its setup, and so in
    the system fingerprint; where none is given the fingerprint is what it was before they counted."""
    from ggufspec.server.props import cache_setup, system_fingerprint
    from ggufspec.session import ModelOptions, open_session
    found = []
    given = ({}, {"rope_freq_base": 20000.0, "rope_scale": 4.0}, {"override_kv": ("llama.context_length=int:300",)})
    for fields in given:
        options = ModelOptions(model=str(tiny_pair[0]), n_ctx=64, n_threads=1, no_draft=True, **fields)
        with open_session(options, log=lambda line: None) as session:
            found.append((system_fingerprint(session.decoder), cache_setup(session.decoder.target_llm)))
    assert len({fingerprint for fingerprint, _ in found}) == 3
    assert set(found[0][1]) == {"file", "cache_types"}
    assert found[1][1]["rope"] == {"rope_freq_base": 20000.0, "rope_freq_scale": 0.25}
    assert found[2][1]["override_kv"] == {"llama.context_length": 300}
