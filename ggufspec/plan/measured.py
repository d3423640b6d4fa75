"""Step costs measured on this machine, for `plan`: what `--draft auto` and `bench` remember in
costs.json (per pair, threads and offload: `speculate._costs_key`), marked by `bench` with the
llama-cpp-python build that measured them, so that figures from another build are not taken for
this one's.
"""
from __future__ import annotations

import os
from importlib import metadata

from ..backends import build_backends, find_lib
from ..costs import Costs, seconds
from ..home import read_json, write_json
from ..simulate import CostCurve

COSTS_FILE = "costs.json"  # speculate.COSTS_FILE (not imported: that would load llama.cpp for a plan)


def build_id() -> str:
    """The llama-cpp-python build: its version, backends, and its libllama's size (a rebuild with
    other flags, AVX-512 or CUDA, changes it)."""
    try:
        version = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        version = "?"
    lib = find_lib("llama")
    size = lib.stat().st_size if lib is not None else 0
    return f"llama-cpp-python {version} ({', '.join(build_backends()) or '?'}; libllama {size} bytes)"


def costs_key(target_path, draft_path, n_threads, ngl: int, ngld: int, tag: str = "") -> str:
    """The decoder's own key, so both sides name an entry alike; `tag`: the load flags that change step
    costs (`load.flags_tag`: -ub, the cache types...), as the decoder adds them."""
    from ..speculate import _costs_key
    return _costs_key(os.fspath(target_path), os.fspath(draft_path), n_threads, ngl, ngld, tag)


def stamp_costs(target_path, draft_path, n_threads, ngl: int, ngld: int, extra: dict | None = None,
                tag: str = "") -> None:
    """Mark the pair's remembered draft-model costs as this build's (with bench's step figures)."""
    key = costs_key(target_path, draft_path, n_threads, ngl, ngld, tag)
    data = read_json(COSTS_FILE)
    entry = data.get(key, {}).get("model")
    if not isinstance(entry, dict):
        return
    entry.update(build=build_id(), **(extra or {}))
    write_json(COSTS_FILE, data)


def _entry(data: dict, target_path, draft_path, n_threads, ngl: int, ngld: int, tag: str = ""):
    """The entry for exactly these settings, else (threads not given) one with any thread count."""
    key = costs_key(target_path, draft_path, n_threads, ngl, ngld, tag)
    if key in data or n_threads is not None:
        return key, data.get(key)
    parts = key.split("|")  # target, draft, t<threads>, ngl<n>, ngld<n>
    same = [other for other in data if len(theirs := other.split("|")) == len(parts)
            and theirs[:2] == parts[:2] and theirs[3:] == parts[3:]]
    if not same:
        return key, None
    from ..load import default_threads  # what a run without -t uses: the nearest thread count's costs
    nearest = min(same, key=lambda other: (abs(_threads(other) - default_threads()), other))
    return nearest, data[nearest]


def _threads(key: str) -> int:
    try:
        return int(key.split("|")[2].lstrip("t"))
    except ValueError:
        return 1 << 30


def measured_curve(target_path, draft_path, n_threads, ngl: int, ngld: int, warn=None,
                   tag: str = "") -> CostCurve | None:
    """The remembered costs of this pair at this offload (and load flags: `tag`) as a simulator curve,
    or None (never measured, too few figures, damaged, or measured by another build: `warn` gets one line)."""
    if target_path is None or draft_path is None:
        return None
    key, entry = _entry(read_json(COSTS_FILE), target_path, draft_path, n_threads, ngl, ngld, tag)
    model = entry.get("model") if isinstance(entry, dict) else None
    if not isinstance(model, dict):
        return None
    built_by = model.get("build")
    if built_by and built_by != build_id():
        if warn:
            warn(f"costs.json: the costs measured for this pair come from another build ({built_by}; this is "
                 f"{build_id()}): estimating instead (`ggufspec bench` measures them again)")
        return None
    try:
        costs = Costs.from_dict(model)
        usable = 1 in costs.batch_times and len(costs.batch_times) >= 2 and costs.t_draft > 0
    except (ValueError, TypeError, AttributeError) as exc:  # only remembered figures: estimate instead
        if warn:
            warn(f"costs.json: the costs remembered for this pair are damaged ({exc}): estimating instead "
                 f"(`ggufspec bench` measures them again)")
        return None
    if not usable:
        return None
    threads = key.split("|")[2][1:]
    where = f"-t {threads}, " if threads != "None" else ""
    try:
        batches = {int(n): seconds(t) for n, t in (model.get("draft_batch") or {}).items()}
        step, row = (_seconds_or_zero(model.get(name)) for name in ("step_seconds", "row_seconds"))
        sampled = bench_costs(model.get("sampled"))
    except (ValueError, TypeError, AttributeError) as exc:
        if warn:
            warn(f"costs.json: bench's figures for this pair are damaged ({exc}): using the costs "
                 f"`--draft auto` remembered (`ggufspec bench` measures them again)")
        batches, step, row, sampled = {}, 0.0, 0.0, None
    return CostCurve(sampled or costs, step, row, f"measured on this machine ({where}-ngl {ngl} -ngld {ngld})",
                     batches, remembered=costs)


def _seconds_or_zero(value) -> float:
    """step_seconds, row_seconds: 0 where bench did not stamp them, else a time (ValueError if damaged)."""
    return 0.0 if value is None or value == 0 else seconds(value)


def bench_costs(sampled) -> Costs | None:
    """The medians bench timed between its runs (the costs its predicted column was checked with),
    where it stamped them: they come before the least times `auto` remembers, which undercount a
    draft token when the draft had sat idle (its catch-up batch, the first proposal's evaluation
    included, is left out of the per-token time) and take the luckiest of a few batches."""
    if not isinstance(sampled, dict) or "target_1" not in sampled or not sampled.get("draft_1"):
        return None
    costs = Costs.from_dict({"batch": {key[7:]: [t] for key, t in sampled.items() if key.startswith("target_")},
                             "draft": [sampled["draft_1"]]})  # checked as remembered costs are
    if len(costs.batch_times) < 2:  # T(1) alone would flatten the curve: keep the fuller remembered costs
        return None
    return costs
