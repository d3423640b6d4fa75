"""The load flags given to ggufspec, as llama.cpp's tools (llama-speculative-simple, llama-completion) take
them: `bench --against-llamacpp` runs both sides of its race loaded alike."""
from __future__ import annotations

# the load flags llama.cpp's tools take for bench --against-llamacpp: the target's (and shared), the draft's
TOOL_FLAGS = {"n_batch": "-b", "n_ubatch": "-ub", "n_threads_batch": "-tb", "cache_type_k": "-ctk", "cache_type_v": "-ctv",
              "override_tensor": "-ot", "n_cpu_moe": "-ncmoe", "cpu_moe": "-cmoe",
              # the CPU and memory ones (`cpuflags`), which llama.cpp's tools give the draft too, as ggufspec does
              "no_host": "--no-host", "check_tensors": "--check-tensors", "numa": "--numa", "lazy_mode": "-lzm",
              "n_cpu_ffn": "-ncffn", "fit": "-fit", "cpu_mask": "-C", "cpu_range": "-Cr", "prio": "--prio"}
TOOL_DRAFT_FLAGS = {"n_threads_draft": "-td", "n_threads_batch_draft": "-tbd", "cache_type_k_draft": "-ctkd",
                    "cache_type_v_draft": "-ctvd", "override_tensor_draft": "-otd", "n_cpu_moe_draft": "-ncmoed",
                    "cpu_moe_draft": "-cmoed"}
# ... and those passed on whenever given, 0 included (--yarn-ext-factor 0 is full interpolation, not its default)
TOOL_GIVEN_FLAGS = {"rope_scaling": "--rope-scaling", "rope_scale": "--rope-scale", "rope_freq_base": "--rope-freq-base",
                    "rope_freq_scale": "--rope-freq-scale", "yarn_orig_ctx": "--yarn-orig-ctx",
                    "yarn_ext_factor": "--yarn-ext-factor", "yarn_attn_factor": "--yarn-attn-factor",
                    "yarn_beta_slow": "--yarn-beta-slow", "yarn_beta_fast": "--yarn-beta-fast",
                    "override_kv": "--override-kv", "split_mode": "-sm", "main_gpu": "-mg", "tensor_split": "-ts",
                    "device": "-dev",
                    # the control vectors, which llama.cpp's tools set on the target alone, as ggufspec does
                    "control_vector": "--control-vector", "control_vector_scaled": "--control-vector-scaled"}
TOOL_DRAFT_GIVEN_FLAGS = {"device_draft": "-devd"}
# ... and the flags of two values (None: not given)
TOOL_PAIR_FLAGS = {"control_vector_layer_range": "--control-vector-layer-range"}
# ... and the switches either side of which may be given (None: neither)
TOOL_SWITCHES = {"kv_offload": {True: "-kvo", False: "-nkvo"}, "op_offload": {True: "--op-offload", False: "--no-op-offload"},
                 "repack": {True: "--repack", False: "-nr"}, "perf": {True: "--perf", False: "--no-perf"}}


def llamacpp_load_args(load: dict) -> tuple[tuple, tuple]:
    """The load flags given, as llama.cpp's tools take them, so that both sides of a race run alike: a
    switch alone, a repeated flag (-ot) once per value; the defaults (None, f16, off, 0) left out, but for
    TOOL_GIVEN_FLAGS', whose defaults are None alone."""
    def given(flags: dict, defaults: tuple = (None, "f16", False, 0)) -> tuple:
        args = []
        for name, flag in flags.items():
            value = load.get(name)
            for one in value if isinstance(value, tuple) else (value,):
                if one is True:
                    args.append(flag)
                elif one not in defaults:
                    args += [flag, str(one)]
        return tuple(args)
    switches = tuple(TOOL_SWITCHES[name][load[name]] for name in TOOL_SWITCHES if load.get(name) is not None)
    pairs = tuple(arg for name, flag in TOOL_PAIR_FLAGS.items() if load.get(name) is not None
                  for arg in (flag, *map(str, load[name])))
    return (given(TOOL_FLAGS) + given(TOOL_GIVEN_FLAGS, (None,)) + switches + pairs,
            given(TOOL_DRAFT_FLAGS) + given(TOOL_DRAFT_GIVEN_FLAGS, (None,)))
