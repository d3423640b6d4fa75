"""Quantize a GGUF with the llama.cpp that llama-cpp-python ships (no llama-quantize binary needed).

    .venv/bin/python benchmarks/quantize.py IN.f16.gguf OUT.gguf [Q4_K_M]

Used to make a random-weight draft of the real draft's shape and type (see docs/benchmarks.md):
    python ../shared/gpu/shape_model.py skeleton DRAFT.gguf d.skel.gguf
    python ../shared/gpu/shape_model.py fill d.skel.gguf d.f16.gguf
    .venv/bin/python benchmarks/quantize.py d.f16.gguf d-random.gguf Q4_K_M
"""
import ctypes
import sys

import llama_cpp


def main(source: str, target: str, kind: str = "Q4_K_M") -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")


if __name__ == "__main__":
    main(*sys.argv[1:])
