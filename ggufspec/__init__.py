"""ggufspec: lossless speculative decoding over GGUF models (llama-cpp-python)."""
# llama_cpp must be loaded before numpy: with CUDA 13 builds, numpy first makes model loading
# segfault in llama_model::print_info (plain llama-cpp-python does it too). Every entry point
# (the API, the CLI, the server) imports this package first, so this one line orders them all.
import llama_cpp  # noqa: F401  (isort: skip)

from .errors import GgufspecError
from .stats import Stats
from .sampling import SamplingParams
from .speculate import Generation, Piece, SpeculativeDecoder

__version__ = "0.1.0"
__all__ = ["SpeculativeDecoder", "Generation", "Piece", "Stats", "SamplingParams", "GgufspecError", "__version__"]
