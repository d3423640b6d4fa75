"""Can the installed llama-cpp-python compute on this CPU? Writes a tiny model and decodes a token.

scripts/install runs it after installing: pip caches the llama-cpp-python wheel by version, not by
the CPU flags it was built with, so a wheel built on a machine with AVX-512 dies with SIGILL on one
without (the CPU of these VMs varies between runs). Exit code 0: fine; killed by SIGILL: rebuild.
"""
import tempfile
from pathlib import Path

import llama_cpp  # before numpy (see ggufspec/__init__.py)

from ggufspec.tinymodels import Shape, make_weights, write_model  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    shape = Shape(n_layer=1, n_embd=64, n_ff=256)  # n_ff 256: the quantized-size kernels run too
    path = write_model(Path(tmp) / "smoke.gguf", shape, make_weights(shape, seed=0))
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    llm.eval([1, 260, 261])
    llm.close()
