"""The `ggufspec` command: results on stdout, progress, logs and statistics on stderr."""
from __future__ import annotations

import functools
import os
import json
import re
import sys

import click

from . import __version__
from .errors import GgufspecError

ACCEPTED_COLOR = "\x1b[36m"  # accepted draft tokens, as llama.cpp's speculative example colours them
RESET_COLOR = "\x1b[0m"


def fail(message: str, exit_code: int = 2):
    click.echo(f"ggufspec: error: {message}", err=True)
    sys.exit(exit_code)


def friendly_errors(command):
    """Turn GgufspecError into a one-line message and its exit code."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GgufspecError as exc:
            fail(str(exc), exc.exit_code)
    return wrapper


def process_escapes(text: str) -> str:
    """llama.cpp's -e: \\n \\r \\t \\' \\" \\\\ and \\xHH."""
    simple = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}

    def replace(match):
        body = match.group(1)
        if body[0] == "x":
            return chr(int(body[1:], 16))
        return simple.get(body, "\\" + body)
    return re.sub(r"\\(x[0-9a-fA-F]{2}|.)", replace, text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ggufspec")
def main():
    """Lossless speculative decoding for GGUF models."""


@main.command(context_settings={"show_default": True})
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), help="Read the prompt from a file.")
@click.option("-n", "--n-predict", default=128, help="Tokens to generate (-1: until EOS or the context is full).")
@click.option("--draft", "n_draft", default="auto", help="Tokens drafted per step, K, or 'auto' (chosen every step, 0 included).")
@click.option("--draft-max", default=8, show_default=True, help="Largest K for --draft auto.")
@click.option("--draft-p-min", default=0.0, help="Stop drafting when the draft's probability of its token is below this.")
@click.option("--lookup", is_flag=True, help="Draft by n-gram lookup in the prompt and output (no draft model needed).")
@click.option("--hybrid", is_flag=True, help="A lookup match when there is one, else the draft model.")
@click.option("--temp", "temperature", default=0.0, help="Temperature (0 or -1: greedy).")
@click.option("--top-k", default=40, help="Top-k (0: off).")
@click.option("--top-p", default=0.95, help="Top-p (1: off).")
@click.option("--min-p", default=0.05, help="Min-p (0: off).")
@click.option("-s", "--seed", type=int, default=None, help="Sampling seed [default: random].")
@click.option("-c", "--ctx-size", "n_ctx", default=4096, help="Context size in tokens.")
@click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads [default: physical cores].")
@click.option("-ngl", "--gpu-layers", "n_gpu_layers", type=int, default=None, help="Target layers on the GPU [default: planned].")
@click.option("-ngld", "--gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None, help="Draft layers on the GPU [default: planned].")
@click.option("-e", "--escape", is_flag=True, help="Process escapes (\\n, \\t, \\xHH...) in the prompt.")
@click.option("--color", is_flag=True, help="Colour the accepted draft tokens.")
@click.option("--chat", is_flag=True, help="Apply the target's chat template.")
@click.option("--system", default=None, help="System message for --chat.")
@click.option("--no-draft", is_flag=True, help="The target alone, for comparison.")
@click.option("--strict", is_flag=True, help="Verify token by token: bit-identical to the target alone, slower.")
@click.option("--json", "as_json", is_flag=True, help="Print text and statistics as one JSON object on stdout.")
@friendly_errors
def run(pair, model, model_draft, prompt, prompt_file, n_predict, n_draft, draft_max, draft_p_min, lookup, hybrid,
        temperature, top_k, top_p, min_p, seed, n_ctx, n_threads, n_gpu_layers, n_gpu_layers_draft, escape, color,
        chat, system, no_draft, strict, as_json):
    """Generate with a target/draft pair (PAIR from models.toml, or -m/-md files)."""
    from .speculate import SpeculativeDecoder
    text = read_prompt(prompt, prompt_file, escape)
    n_draft = parse_draft(n_draft)
    if lookup and hybrid:
        raise GgufspecError("choose one of --lookup and --hybrid")
    drafter = "lookup" if lookup else "hybrid" if hybrid else "model"
    target_path, draft_path, pair_k = resolve_models(pair, model, model_draft, no_draft or lookup)
    n_gpu_layers, n_gpu_layers_draft = planned_offload(target_path, None if no_draft or lookup else draft_path,
                                                       n_ctx, pair_k or 3, n_gpu_layers, n_gpu_layers_draft)
    with SpeculativeDecoder(target_path, None if no_draft or lookup else draft_path, n_ctx=n_ctx, n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft,
                            strict=strict) as decoder:
        stream = decoder.stream(text, n_predict=n_predict, n_draft=n_draft, temperature=temperature,
                                top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, chat=chat, system=system,
                                use_draft=not no_draft, drafter=drafter, draft_p_min=draft_p_min,
                                draft_max=draft_max)
        interrupted, pieces = write_stream(stream, color=color, quiet=as_json)
        stats = decoder.last_stats
        if interrupted:
            stats.stop_reason = "interrupted"
    if as_json:
        click.echo(json.dumps({"text": "".join(p.text for p in pieces), "tokens": [p.token for p in pieces],
                               "stats": stats.to_dict()}))
    else:
        click.echo("\n", err=True)
        click.echo(stats.llamacpp_block(), err=True)
    if interrupted:
        sys.exit(130)


def parse_draft(value: str):
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise GgufspecError(f"--draft takes a number K >= 1 or 'auto', got {value!r}") from None


def planned_offload(target_path, draft_path, n_ctx, n_draft, ngl, ngld):
    """-ngl / -ngld as given, else from the planner (only where this build can offload at all)."""
    from . import plan as P
    if (ngl is not None and (ngld is not None or draft_path is None)) or not P.gpu_offload_supported():
        return ngl or 0, ngld if ngld is not None else (ngl or 0)
    target = P.read_shape(target_path)
    draft = P.read_shape(draft_path) if draft_path else None
    gpu, host = _devices(None, None)
    result = P.make_plan(target, draft, gpu=gpu, ram=host, n_ctx=n_ctx, ctx_given=True, n_draft=n_draft)
    click.echo(result.summary(), err=True)
    planned_draft = result.draft.n_gpu_layers if result.draft else 0
    return (ngl if ngl is not None else result.target.n_gpu_layers,
            ngld if ngld is not None else planned_draft)


def read_prompt(prompt: str | None, prompt_file, escape: bool) -> str:
    if prompt is not None and prompt_file is not None:
        raise GgufspecError("give the prompt with -p or -f, not both")
    text = prompt_file.read() if prompt_file is not None else prompt
    if text is None:
        raise GgufspecError("no prompt: give one with -p TEXT or -f FILE")
    return process_escapes(text) if escape else text


def resolve_models(pair, model, model_draft, no_draft):
    """Target and draft paths (and the pair's recommended K) from -m/-md or a registry pair."""
    if model is not None:
        if pair is not None:
            raise GgufspecError("give a PAIR name or -m/-md files, not both")
        if model_draft is None and not no_draft:
            raise GgufspecError("-m needs a draft model too: add -md DRAFT.gguf (or --no-draft for the target alone)")
        from .store import resolve_model_arg
        return resolve_model_arg(model), model_draft and resolve_model_arg(model_draft), None
    from . import store
    return store.pair_paths(pair)


def write_stream(stream, *, color: bool, quiet: bool):
    """Print pieces as they come; returns (interrupted, pieces). Ctrl-C ends generation cleanly."""
    collected = []
    out = sys.stdout
    try:
        for piece in stream:
            collected.append(piece)
            if quiet:
                continue
            if color and piece.from_draft:
                out.write(ACCEPTED_COLOR + piece.text + RESET_COLOR)
            else:
                out.write(piece.text)
            out.flush()
        return False, collected
    except KeyboardInterrupt:
        stream.close()
        return True, collected


def _model_entries(name: str):
    """The models a name stands for: a pair's two, a single model's one, or a hub reference."""
    from .registry import load_registry
    from .store import entry_from_reference
    registry = load_registry()
    if name in registry.pairs:
        pair = registry.pairs[name]
        return [registry.model(pair.target), registry.model(pair.draft)]
    if name in registry.models:
        return [registry.models[name]]
    entry = entry_from_reference(name)
    if entry is None:
        raise GgufspecError(f"unknown pair or model {name!r}: see `ggufspec list`, or give hf://OWNER/REPO/FILE.gguf "
                            f"or OWNER/REPO:QUANT")
    return [entry]


@main.command()
@click.argument("name", required=False)
@click.option("--dry-run", is_flag=True, help="Say what would be fetched and how big it is.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no progress bars).")
@friendly_errors
def pull(name, dry_run, quiet, as_json):
    """Fetch a pair or model (default: the default pair) into the cache, verified and resumable."""
    from . import store
    from .registry import load_registry
    name = name or load_registry().default
    results = []
    for entry in _model_entries(name):
        if dry_run:
            remote = [] if store.is_complete(entry) else store.remote_files(entry)
            results.append({"model": entry.name, "repo": entry.repo, "files": [r.file for r in remote],
                            "bytes": sum(r.size or 0 for r in remote), "on_disk": store.is_complete(entry)})
            continue
        paths = store.pull(entry, progress=not (quiet or as_json))
        results.append({"model": entry.name, "path": str(paths[0]), "bytes": store.size_on_disk(entry)})
    if as_json:
        click.echo(json.dumps(results))
        return
    for r in results:
        if dry_run:
            what = "already on disk" if r["on_disk"] else f"would fetch {len(r['files'])} file(s), {store.human_size(r['bytes'])}"
            click.echo(f"{r['model']}: {what}")
        else:
            click.echo(f"{r['model']}: {r['path']} ({store.human_size(r['bytes'])})")


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@friendly_errors
def list_(as_json):
    """Pairs and models in models.toml, their sizes, and whether they are on disk."""
    from . import store
    from .registry import load_registry
    registry = load_registry()
    models = {name: {"repo": m.repo, "files": list(m.files), "size": m.size, "on_disk": store.is_complete(m),
                     "path": str(store.final_path(m, m.first_file)) if store.is_complete(m) else None}
              for name, m in registry.models.items()}
    pairs = {name: {"target": p.target, "draft": p.draft, "draft_k": p.draft_k, "note": p.note,
                    "default": name == registry.default,
                    "on_disk": models[p.target]["on_disk"] and models[p.draft]["on_disk"]}
             for name, p in registry.pairs.items()}
    if as_json:
        click.echo(json.dumps({"default": registry.default, "pairs": pairs, "models": models}, indent=2))
        return
    click.echo("PAIRS")
    for name, p in pairs.items():
        mark = "*" if p["default"] else " "
        disk = "on disk" if p["on_disk"] else ""
        click.echo(f"{mark} {name:<22} {p['target']} + {p['draft']} (draft {p['draft_k']}) {disk}")
    click.echo("\nMODELS")
    for name, m in models.items():
        click.echo(f"  {name:<38} {store.human_size(m['size']):>10}  {'on disk' if m['on_disk'] else ''}")
    click.echo("\n* default pair")


@main.command()
@click.argument("name")
@friendly_errors
def rm(name):
    """Delete a pair's or model's files from the cache."""
    from . import store
    for entry in _model_entries(name):
        freed = store.remove(entry)
        click.echo(f"{entry.name}: removed {store.human_size(freed)}")


def _shapes_for(pair, model, model_draft):
    """Model shapes from local files, or from registry entries (headers over HTTP when not on disk)."""
    from . import plan as P
    from . import store
    if model is not None:
        return P.read_shape(model), (P.read_shape(model_draft) if model_draft else None)
    from .registry import load_registry
    registry = load_registry()
    p = registry.pair(pair)
    shapes = []
    for name in (p.target, p.draft):
        entry = registry.model(name)
        if store.is_complete(entry):
            shapes.append(P.read_shape(store.final_path(entry, entry.first_file), name))
        else:
            remote = store.remote_files(entry)[0]
            shapes.append(P.read_remote_shape(remote.url, remote.size or entry.size, name))
    return shapes[0], shapes[1]


def _devices(vram, ram):
    from . import plan as P
    if vram is not None:
        size = P.parse_size(vram)
        gpu = P.Device("cuda", f"GPU ({vram})", size, size, P.DEFAULT_GPU_BANDWIDTH_GBS)
    else:
        gpus = P.detect_gpus()
        gpu = max(gpus, key=lambda g: g.free) if gpus else None
    host = P.detect_ram()
    if ram is not None:
        host.total = host.free = P.parse_size(ram)
    return gpu, host


@main.command()
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--vram", default=None, help="Plan for this much GPU memory (e.g. 24GiB) instead of the detected.")
@click.option("--ram", default=None, help="Plan for this much host memory instead of the detected.")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=None, help="Context size [default: 4096, shrunk to fit].")
@click.option("--draft", "n_draft", type=int, default=3, show_default=True, help="Tokens drafted per step, K.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@friendly_errors
def plan(pair, model, model_draft, vram, ram, n_ctx, n_draft, as_json):
    """Plan GPU offload (-ngl / -ngld) for a pair from its GGUF headers and this machine."""
    from . import plan as P
    target, draft = _shapes_for(pair, model, model_draft)
    gpu, host = _devices(vram, ram)
    result = P.make_plan(target, draft, gpu=gpu, ram=host, n_ctx=n_ctx or 4096, ctx_given=n_ctx is not None,
                         n_draft=n_draft)
    if as_json:
        click.echo(json.dumps({"ngl": result.target.n_gpu_layers,
                               "ngld": result.draft.n_gpu_layers if result.draft else 0,
                               "use_draft": result.draft is not None,
                               "n_ctx": result.n_ctx, "reason": result.reason,
                               "predicted_tps": result.predicted_tps,
                               "predicted_target_alone_tps": result.predicted_target_alone_tps,
                               "plan": result.to_dict()}, default=str))
        return
    click.echo(P.plan_table(result, target, draft))
    click.echo(result.summary())
    if gpu is not None and vram is None and not P.gpu_offload_supported():
        click.echo("note: this llama-cpp-python build cannot offload to a GPU; rebuild it with "
                   "CMAKE_ARGS=\"-DGGML_CUDA=on\" (see the README) to use this plan", err=True)


@main.command()
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--prompts", "prompts_file", default=None, help="JSONL prompts (id, kind chat|raw, prompt) [default: the seed set].")
@click.option("--draft", "drafts", default="1,2,3,4,6,8,auto", show_default=True, help="Configurations: K values and 'auto'.")
@click.option("--lookup", is_flag=True, help="Also run the n-gram lookup drafter.")
@click.option("--hybrid", is_flag=True, help="Also run the hybrid (lookup, else draft model) drafter.")
@click.option("--draft-p-min", default=0.0, help="Confidence gating for the draft model.")
@click.option("-n", "--n-predict", default=256, show_default=True)
@click.option("--repeat", default=1, show_default=True, help="Runs of each configuration per prompt.")
@click.option("--temp", "temperature", default=0.0, show_default=True)
@click.option("-s", "--seed", default=1, show_default=True)
@click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True)
@click.option("-t", "--threads", "n_threads", type=int, default=None)
@click.option("--limit", type=int, default=None, help="Only the first N prompts.")
@click.option("--against-llamacpp", "llamacpp", default=None, help="Path to llama-speculative-simple: race it too.")
@click.option("--json", "as_json", is_flag=True, help="Results as JSON on stdout.")
@click.option("--plot", "plot_file", default=None, help="Write a PNG of speedup and acceptance against K.")
@friendly_errors
def bench(pair, model, model_draft, prompts_file, drafts, lookup, hybrid, draft_p_min, n_predict, repeat,
          temperature, seed, n_ctx, n_threads, limit, llamacpp, as_json, plot_file):
    """Measure the target alone against speculative configurations, interleaved, per prompt."""
    from tqdm.auto import tqdm

    from . import bench as B
    from .speculate import SpeculativeDecoder
    target_path, draft_path, _ = resolve_models(pair, model, model_draft, False)
    if llamacpp and not os.access(llamacpp, os.X_OK):
        raise GgufspecError(f"--against-llamacpp: {llamacpp} is not an executable (build it: scripts/build-llamacpp.sh)")
    configs = B.parse_configs(drafts, lookup, hybrid, llamacpp, draft_p_min)
    prompts = B.load_prompts(prompts_file)[:limit]
    with SpeculativeDecoder(target_path, draft_path, n_ctx=n_ctx, n_threads=n_threads) as decoder:
        with tqdm(total=len(prompts) * repeat * len(configs), desc="bench", file=sys.stderr,
                  disable=as_json) as progress:
            result = B.run_bench(decoder, prompts, configs, n_predict=n_predict, repeat=repeat,
                                 temperature=temperature, seed=seed, progress=progress, llamacpp=llamacpp,
                                 n_threads=n_threads)
        ks = [int(c.name[2:]) for c in configs if c.name.startswith("K=")]
        B.add_cost_model(result, B.measure_costs(decoder, max(ks, default=3)))
    if plot_file:
        B.plot(result, plot_file)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else B.markdown(result))


if __name__ == "__main__":
    main()
