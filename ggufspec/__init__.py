"""ggufspec: lossless speculative decoding over GGUF models (llama-cpp-python)."""
from .errors import GgufspecError
from .report import Stats
from .sampling import SamplingParams
from .speculate import Generation, Piece, SpeculativeDecoder

__version__ = "0.1.0"
__all__ = ["SpeculativeDecoder", "Generation", "Piece", "Stats", "SamplingParams", "GgufspecError", "__version__"]
