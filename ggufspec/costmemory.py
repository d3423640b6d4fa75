"""Step costs remembered between runs, per pair, threads and offload: where `--draft auto` starts from."""
from __future__ import annotations

from .costs import Costs

# ---------------------------------------------------------------- step costs remembered between runs
# The adaptive controller learns what a draft token and a target batch cost on this machine. That
# takes a few probing steps, which on a CPU where drafting cannot pay are pure loss; remembering the
# figures (per pair, threads and offload) lets the next run start from what is known.

def _costs_key(target, draft, n_threads, ngl, ngld, tag: str = "") -> str | None:
    import os
    paths = [m for m in (target, draft) if isinstance(m, (str, bytes)) or hasattr(m, "__fspath__")]
    if len(paths) != sum(m is not None for m in (target, draft)):
        return None  # Llama objects given: no stable identity to remember them by
    ident = [f"{os.path.abspath(os.fspath(p))}:{os.path.getsize(p)}" for p in paths]
    return "|".join(ident + [f"t{n_threads}", f"ngl{ngl}", f"ngld{ngld}"] + ([tag] if tag else []))


def offloaded_layers(ngl: int, n_layer: int) -> int:
    """-ngl as llama.cpp applies it, for the key: a negative count, or more layers than the model has,
    means all of them with the output layer (n_layer + 1). So -ngl 99, -ngl -1 and the planner's
    n_layer + 1 name one offload: on the H100, costs bench measured at -ngl 99 were not found by
    `plan`, which asked for -ngl 29."""
    return n_layer + 1 if ngl < 0 or ngl > n_layer + 1 else ngl


def offload_as_applied(decoder) -> tuple[int, int]:
    """(-ngl, -ngld) as llama.cpp applied them to the decoder's models: what the costs remembered for its pair
    are filed under, and what `bench` stamps for `plan`."""
    from .load import layer_count
    ngl = offloaded_layers(decoder.n_gpu_layers, layer_count(decoder.target_llm))
    ngld = decoder.n_gpu_layers_draft
    if decoder.draft_llm is not None:
        ngld = offloaded_layers(ngld, layer_count(decoder.draft_llm))
    return ngl, ngld


COSTS_FILE = "costs.json"  # in ggufspec's home


def _load_costs(key: str | None) -> dict[str, Costs]:
    from .home import read_json
    if key is None:
        return {}
    try:
        entry = read_json(COSTS_FILE).get(key, {})
        return {drafter: Costs.from_dict(data) for drafter, data in entry.items()}
    except (ValueError, TypeError, AttributeError):
        return {}  # a damaged entry only costs the remembered figures


def _save_costs(key: str | None, costs: dict[str, Costs]) -> None:
    learned = {drafter: c.to_dict() for drafter, c in costs.items() if c.batch_times}
    if key is None or not learned:
        return
    from .home import read_json, write_json
    data = read_json(COSTS_FILE)
    data[key] = learned
    write_json(COSTS_FILE, data)
