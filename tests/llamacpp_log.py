"""Load a model with llama.cpp's log captured, and read back the buffer sizes it reports."""
import ctypes
import re

import llama_cpp

MiB = 1 << 20


def buffer_sizes(path, n_ctx, n_batch=512, **params):
    lines = []

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                              n_threads=1, verbose=True, **params)
        llm.close()
    finally:
        from ggufspec.llamalog import quiet_llama_logs
        quiet_llama_logs()
    log = "".join(lines)

    def total(pattern):
        return sum(float(v) for v in re.findall(pattern, log)) * MiB
    # CPU_REPACK is a second, re-laid-out copy of some CPU-resident matrices (host RAM only), not weights
    return {"model": total(r"(?<!REPACK) model buffer size =\s+([\d.]+) MiB"),
            "repack": total(r"REPACK model buffer size =\s+([\d.]+) MiB"),
            "kv": total(r"KV buffer size =\s+([\d.]+) MiB"),
            "compute": total(r"compute buffer size =\s+([\d.]+) MiB\n")}
