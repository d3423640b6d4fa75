"""Commands about models and machines: pull, list, rm, plan, worker (no generation)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import GgufspecError
from .app import friendly_errors, main
from .bounds import threads, tokens
from .options import cache_type_options, options, tensor_placement_options


def _model_entries(name: str):
    """The models a name stands for: a pair's two, a single model's one, or a hub reference or URL."""
    from ..registry import load_registry
    from ..store import entry_from_reference
    registry = load_registry()
    if name in registry.pairs:
        pair = registry.pairs[name]
        return [registry.model(pair.target), registry.model(pair.draft)]
    if name in registry.models:
        return [registry.models[name]]
    entry = entry_from_reference(name)
    if entry is None:
        from ..hubrefs import hub_form_hint
        from ..registry import did_you_mean
        hint = (did_you_mean(name, [*registry.pairs, *registry.models]) or hub_form_hint(name)
                or ": see `ggufspec list`, or give hf://OWNER/REPO/FILE.gguf, OWNER/REPO:QUANT, hf://OWNER/REPO or "
                   "a GGUF file's http(s) URL")
        raise GgufspecError(f"unknown pair or model {name!r}{hint}")
    return [entry]


@main.command()
@click.argument("name", required=False)
@click.option("--with-draft", is_flag=True,
              help="For hf://OWNER/REPO/FILE.gguf: also find a draft on the hub (same repository or family, 5x "
                   "smaller, same tokenizer: read from the GGUF headers) and pull it.")
@click.option("--dry-run", is_flag=True, help="Say what would be fetched and how big it is.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no progress bars).")
@friendly_errors
def pull(name, with_draft, dry_run, quiet, as_json):
    """Fetch a pair or model (default: the default pair) into the cache, verified and resumable: a name
    from `ggufspec list`, hf://OWNER/REPO/FILE.gguf, OWNER/REPO:QUANT, hf://OWNER/REPO (its Q4_K_M, else
    Q8_0, else first model: llama.cpp's -hf OWNER/REPO) or a GGUF file's http(s) URL (llama.cpp's -mu)."""
    from .. import store
    from ..registry import load_registry
    registry = load_registry()
    if name is not None and not name.strip():
        raise GgufspecError("an empty name: give a pair or model (`ggufspec list` shows them), or none for "
                            "the default pair")
    name = name or registry.default
    pair_with_draft, with_draft = with_draft and name in registry.pairs, with_draft and name not in registry.pairs
    if with_draft and (name in registry.models or not name.startswith("hf://")):
        raise GgufspecError(f"--with-draft needs a hub file reference hf://OWNER/REPO/FILE.gguf "
                            f"(or a pair name, which brings its draft), not {name!r}")
    entries, search = _model_entries(name), None
    if with_draft:
        from ..hubdraft import find_draft
        search = find_draft(entries[0], registry)
        entries += [search.draft] if search.draft else []
    results = []
    for entry in entries:
        if dry_run:
            remote = [] if store.is_complete(entry) else store.remote_files(entry)
            results.append({"model": entry.name, "repo": entry.repo, "files": [r.file for r in remote],
                            "bytes": sum(r.size or 0 for r in remote), "on_disk": store.is_complete(entry)})
            continue
        try:
            paths = store.pull(entry, progress=not (quiet or as_json))
        except KeyboardInterrupt:  # what arrived is kept in the partial file
            error = GgufspecError(f"{entry.name}: interrupted; what was downloaded is kept: run the same pull "
                                  f"again to resume")
            error.exit_code = 130  # the shell's code for Ctrl-C, as `run` exits
            raise error from None
        results.append({"model": entry.name, "path": str(paths[0]), "bytes": store.size_on_disk(entry)})
    if search is not None:
        results[0]["draft_search"] = search.as_dict()
    if as_json:
        click.echo(json.dumps(results))
        return
    for r in results:
        if dry_run:
            what = "already on disk" if r["on_disk"] else f"would fetch {len(r['files'])} file(s), {store.human_size(r['bytes'])}"
            click.echo(f"{r['model']}: {what}")
        else:
            click.echo(f"{r['model']}: {r['path']} ({store.human_size(r['bytes'])})")
    if search is not None:
        click.echo(search.line())
        for skipped in search.skipped:
            click.echo(f"  skipped {skipped['model']}: {skipped['reason']}")
    elif pair_with_draft:  # a pair brings its own draft
        click.echo(f"{name} is a pair: its draft {registry.pairs[name].draft} was pulled with it")


def _sizes(registry, remote: bool) -> dict[str, int | None]:
    """Each model's size, known offline or (--remote) asked of the hub. A model the hub does not answer
    for is left unknown, with a warning, and the others are still listed; an unreachable hub is asked
    once, not once a model."""
    from .. import store
    from ..errors import StoreError
    from ..huberrors import HubUnreachable
    sizes, ask = {}, remote
    for name, m in registry.models.items():
        sizes[name] = store.known_size(m)
        if sizes[name] is None and ask:
            try:
                sizes[name] = store.remote_size(m)
            except HubUnreachable as exc:
                click.echo(f"ggufspec: warning: {exc}; sizes not known offline are left out", err=True)
                ask = False
            except StoreError as exc:
                click.echo(f"ggufspec: warning: {name}: {exc}", err=True)
    return sizes


@main.command(name="list")
@click.option("--remote", is_flag=True, help="Ask the hub for sizes not known offline.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@friendly_errors
def list_(remote, as_json):
    """Pairs and models in models.toml, their sizes, and whether they are on disk."""
    from .. import store
    from ..registry import load_registry
    from . import stored
    registry = load_registry()
    sizes = _sizes(registry, remote)
    models = {name: {"repo": m.repo, "files": list(m.files), "size": sizes[name],
                     "sha256": {f: v["sha256"] for f, v in store.verified_files(m).items()} or m.sha256,
                     "on_disk": store.is_complete(m),
                     "path": str(store.final_path(m, m.first_file)) if store.is_complete(m) else None}
              for name, m in registry.models.items()}
    pairs = {name: {"target": p.target, "draft": p.draft, "draft_k": p.draft_k, "note": p.note,
                    "default": name == registry.default,
                    "on_disk": models[p.target]["on_disk"] and models[p.draft]["on_disk"]}
             for name, p in registry.pairs.items()}
    others, partial = stored.other_models(registry), stored.partial_downloads(registry)
    if as_json:
        click.echo(json.dumps({"default": registry.default, "pairs": pairs, "models": models, "other_models": others,
                               "partial_downloads": {"bytes": sum(p["bytes"] for p in partial), "files": partial}},
                              indent=2))
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
    _print_unlisted(others, partial)
    click.echo("\n* default pair")


def _print_unlisted(others: dict, partial: list[dict]) -> None:
    """The files no registry entry names (pulled by hub reference), and the downloads left unfinished."""
    from .. import store
    if others:
        click.echo("\nOTHER MODELS (pulled by hub reference or URL; not in models.toml)")
        for ref, m in others.items():
            click.echo(f"  {ref:<38} {store.human_size(m['size']):>20}  on disk")
    if partial:
        click.echo(f"\nPARTIAL DOWNLOADS ({store.human_size(sum(p['bytes'] for p in partial))}: `ggufspec pull NAME` "
                   f"resumes, `ggufspec rm NAME` deletes)")
        for p in partial:
            click.echo(f"  {p['name']:<38} {store.human_size(p['bytes']):>20}")


@main.command()
@click.argument("name")
@friendly_errors
def rm(name):
    """Delete a pair's or model's files from the cache (what `list` shows). A model another pair on disk
    also uses is kept when a pair is removed; named alone, it is removed."""
    from .. import store
    from ..registry import load_registry
    from . import stored
    registry = load_registry()
    others = stored.other_models(registry)
    if name in others and not name.startswith("hf://"):  # a file put there by hand, named by its path as in `list`
        return _remove_paths(name, [Path(p) for p in others[name]["files"]])
    entries = list({entry.name: entry for entry in _model_entries(name)}.values())  # a pair may be one model twice
    on_disk = [entry for entry in entries if store.files_on_disk(entry)]
    removable = on_disk
    if name in registry.pairs:  # a model that another pair on disk uses is not this pair's alone
        removable = [entry for entry in on_disk if not _kept(registry, name, entry.name)]
    if not removable:
        kept = " but what other pairs use" if on_disk else ""
        raise GgufspecError(f"{name}: nothing of it is on disk{kept}, so nothing was removed "
                            f"(`ggufspec list` shows what is)")
    for entry in removable:
        freed = store.remove(entry)
        click.echo(f"{entry.name}: removed {store.human_size(freed)}")
        if name not in registry.pairs:
            _note_pairs_left_without(registry, entry)


def _note_pairs_left_without(registry, entry) -> None:
    """After removing a model by name or by hub reference: the pairs on disk it leaves without it (a
    reference may name a registry model's file)."""
    from .. import store
    from . import stored
    files = stored.registry_files(registry)
    models = {files[path] for path in (store.final_path(entry, f) for f in entry.files) if path in files}
    left_without = {used for model in models | {entry.name} for used in stored.pairs_using(registry, model)}
    for pair, role in sorted(left_without):  # once each, however many names the files have
        click.echo(f"ggufspec: note: {pair} has no {role} on disk now (`ggufspec pull {pair}` brings it back)",
                   err=True)


def _kept(registry, pair: str, model: str) -> bool:
    """Whether `rm PAIR` keeps `model`, because another pair on disk uses it (said on stderr)."""
    from . import stored
    users = stored.pairs_using(registry, model, besides=pair)
    if users:
        click.echo(stored.kept_line(model, users), err=True)
    return bool(users)


def _remove_paths(name: str, paths: list[Path]) -> None:
    from .. import store
    freed = 0
    for path in paths:
        freed += path.stat().st_size
        path.unlink()
    click.echo(f"{name}: removed {store.human_size(freed)}")


def costs_flags_tag(n_ubatch, type_k, type_v, type_k_draft, type_v_draft, **placement) -> str:
    """The costs key's tag for plan's load flags, as a decoder loaded with them names its costs (bench's);
    `placement`: the tensor override flags (ModelOptions' override_tensor, cpu_moe...)."""
    from ..load import flags_tag
    from ..session import ModelOptions, load_flags_by_role
    return flags_tag(load_flags_by_role(ModelOptions(n_ubatch=n_ubatch, cache_type_k=type_k, cache_type_v=type_v,
                                                     cache_type_k_draft=type_k_draft, cache_type_v_draft=type_v_draft,
                                                     **placement)))


def _shapes_for(pair, model, model_draft):
    """(target shape, draft shape or None, (target path, draft path) where both are on disk, else
    (None, None), and each one's path or None): from -m/-md (paths or hub references, as `run` takes
    them) or a registry pair. What is not on disk is read from its header over HTTP (range requests),
    never downloaded."""
    from ..plan import speculation as S
    if model is None:
        if model_draft is not None:  # as run and bench refuse it, not a silent plan of the default pair
            raise GgufspecError("-md needs -m (the target it drafts for); a PAIR name brings its own draft")
        (target, target_path), (draft, draft_path) = _pair_shapes(pair)
        return target, draft, S.local_pair_paths(pair, None, None), (target_path, draft_path)
    if pair is not None:
        raise GgufspecError("give a PAIR name or -m/-md files, not both")
    target, target_path = _given_shape(model)
    draft, draft_path = _given_shape(model_draft) if model_draft else (None, None)
    both = (target_path, draft_path) if target_path and draft_path else (None, None)
    return target, draft, both, (target_path, draft_path)


def _pair_shapes(pair):
    from ..registry import load_registry
    registry = load_registry()
    p = registry.pair(pair)
    return tuple(_entry_shape(registry.model(name), name) for name in (p.target, p.draft))


def _kept_on_host(shape, path, overrides, flag: str):
    """The shape with the tensors -ot/--cpu-moe/--n-cpu-moe (or the draft's) keep on the CPU out of the
    GPU's share: their names are read from the file, which must be on disk."""
    from .. import plan as planner
    if not overrides or shape is None:
        return shape
    if path is None:
        raise GgufspecError(f"{flag}: plan reads the tensor names from the model's file, and {shape.name} is not on "
                            f"disk: fetch it first (ggufspec pull), or plan without it")
    return planner.kept_on_host(shape, path, overrides)


def _given_shape(arg: str):
    """A -m/-md model's (shape, local path or None): a GGUF path, or a hub reference resolved as
    `run -m` resolves it (`store.entry_from_reference`), its header read where the file is."""
    from .. import plan as planner
    from .. import store
    entry = None if Path(arg).exists() else store.entry_from_reference(arg)
    if entry is None:
        return planner.read_shape(arg), arg
    return _entry_shape(entry, arg)


def _entry_shape(entry, name: str):
    """A store entry's (shape, local path or None): from the cache, else its header over HTTP."""
    from .. import plan as planner
    from .. import store
    if store.is_complete(entry):
        path = str(store.final_path(entry, entry.first_file))
        return planner.read_shape(path, name), path
    first, *shards = store.remote_files(entry)  # a split GGUF's first shard holds the metadata
    return planner.read_remote_shape(first.url, first.size or entry.size, name,
                                     shards=tuple((shard.url, shard.size or entry.size) for shard in shards)), None


@main.command(name="plan")
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--vram", default=None, help="Plan for this much GPU memory (e.g. 24GiB) instead of the detected.")
@click.option("--ram", default=None, help="Plan for this much host memory instead of the detected.")
@click.option("-c", "--ctx-size", "n_ctx", type=tokens(), default=None,
              help="Context size [default: 4096, shrunk to fit].")
@click.option("--draft", "n_draft", type=click.IntRange(min=1), default=3, show_default=True,
              help="Tokens drafted per step, K.")
@click.option("-t", "--threads", "n_threads", type=threads(), default=None,
              help="Threads the pair will run with (which measured costs apply) [default: any measured].")
@click.option("--trace", "trace_files", multiple=True, metavar="FILE",
              help="The pair's acceptance trace(s) (bench --record-trace) [default: the known ones].")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]", help="Plan the target across these workers.")
@click.option("--rpc-mem", multiple=True, metavar="HOST:PORT=SIZE",
              help="A worker's memory, to plan without contacting it (repeatable).")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=tokens(), default=512, show_default=True,
              metavar="N", help="The micro-batch the pair will run with (it sizes the compute buffer).")
@options(*cache_type_options(), *tensor_placement_options())
@click.option("-kvo/-nkvo", "--kv-offload/--no-kv-offload", "kv_offload", default=None,
              help="Plan with the KV cache on the GPU with its layers, or (-nkvo) all of it in host memory, as run "
                   "and serve load it [default: on the GPU].")
@click.option("-ncffn", "--n-cpu-ffn", "n_cpu_ffn", type=click.IntRange(min=0), default=0, metavar="N",
              help="Plan with the target's dense FFN weights of its first N layers kept on the CPU (run's -ncffn).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@friendly_errors
def plan_command(pair, model, model_draft, vram, ram, n_ctx, n_draft, n_threads, trace_files, rpc, rpc_mem, n_ubatch,
                 cache_type_k, cache_type_v, cache_type_k_draft, cache_type_v_draft, as_json, **placement):
    """Plan GPU offload (-ngl / -ngld) for a pair from its GGUF headers and this machine, and say
    whether the draft pays here: measured costs where bench or --draft auto remembered them,
    estimated otherwise; acceptance from the pair's traces, assumed otherwise."""
    from .. import plan as planner
    from ..plan import measured as M
    from ..plan import speculation as S
    from ..session import memory_devices
    from ..simulate import merged
    from .options import check_rpc
    check_rpc(rpc)  # an empty --rpc too: one line, not a plan that is silently local
    if rpc_mem and rpc is None:
        raise GgufspecError("--rpc-mem declares the memory of --rpc's workers: give --rpc too")
    placed = _placement_flags(placement, rpc)  # bad ones fail before any header is read
    target, draft, local_paths, each_path = _shapes_for(pair, model, model_draft)
    # as they will load: the cache types (-ctk q8_0 holds about half f16's bytes) and -ub size their buffers,
    # and what the tensor overrides keep on the CPU (--cpu-moe's experts) is not the GPU's
    kv_on_gpu = placement.get("kv_offload") is not False  # -nkvo: both models' caches in host memory
    target = _kept_on_host(planner.loaded_as(target, cache_type_k, cache_type_v, n_ubatch, kv_on_gpu), each_path[0],
                           placed["target"], "-ot/--cpu-moe/--n-cpu-moe/-ncffn")
    draft = _kept_on_host(draft and planner.loaded_as(draft, cache_type_k_draft, cache_type_v_draft, n_ubatch,
                                                      kv_on_gpu),
                          each_path[1], placed["draft"], "-otd/--cpu-moe-draft/--n-cpu-moe-draft")
    if rpc is not None:
        return _print_rpc_plan(target, rpc, rpc_mem, n_ctx or 4096, as_json)
    gpu, host = memory_devices(vram, ram)
    target_path, draft_path = local_paths if draft is not None else (None, None)
    traces = S.pair_traces(target_path, draft_path, trace_files) if draft is not None else []
    warnings: list[str] = []
    measured = None
    if vram is None and ram is None:  # measured costs are this machine's as it is, not a declared one
        tag = costs_flags_tag(n_ubatch, cache_type_k, cache_type_v, cache_type_k_draft, cache_type_v_draft, **placement)
        measured = lambda ngl, ngld: M.measured_curve(target_path, draft_path, n_threads, ngl, ngld,  # noqa: E731
                                                      warnings.append, tag)
    result = planner.make_plan(target, draft, gpu=gpu, ram=host, n_ctx=n_ctx or 4096, ctx_given=n_ctx is not None,
                               n_draft=n_draft, trace=merged(traces), measured=measured)
    for line in dict.fromkeys(warnings):
        click.echo(line, err=True)
    curve = getattr(result, "draft_curve", None)
    found = S.outlooks(curve, traces, planner.DEFAULT_ACCEPTANCE, n_draft) if curve is not None else []
    if as_json:
        click.echo(json.dumps({"ngl": result.target.n_gpu_layers,
                               "ngld": result.draft.n_gpu_layers if result.draft else 0,
                               "ngld_with_fixed_k": result.draft_if_used.n_gpu_layers if result.draft_if_used else 0,
                               "use_draft": result.draft is not None,
                               "n_ctx": result.n_ctx, "reason": result.reason,
                               "predicted_tps": result.predicted_tps,
                               "predicted_target_alone_tps": result.predicted_target_alone_tps,
                               "estimated": not result.costs_source.startswith("measured"),
                               "costs": result.costs_source, "acceptance": result.acceptance_source,
                               "draft": [vars(o) | {"pays": o.pays} for o in found],
                               "backends": planner.build_backends(), "plan": result.to_dict()}, default=str))
        return
    click.echo(planner.plan_table(result, target, draft))
    click.echo(result.summary())
    if curve is not None:
        click.echo("\n".join(S.outlook_lines(found, curve, traces, planner.DEFAULT_ACCEPTANCE, n_draft)))
    if gpu is not None and vram is None and not planner.gpu_offload_supported():
        click.echo("note: this llama-cpp-python build cannot offload to a GPU; rerun scripts/install (CUDA when "
                   "nvcc and an NVIDIA GPU are found; GGUFSPEC_CUDA=1 forces it), or rebuild it with "
                   "CMAKE_ARGS=\"-DGGML_CUDA=on\" (see the README) to use this plan", err=True)


def _placement_flags(placement: dict, rpc: str | None) -> dict[str, tuple]:
    """The tensor overrides plan's flags give each model (`session.load_flags_by_role` checks them)."""
    from ..session import ModelOptions, load_flags_by_role
    flags = load_flags_by_role(ModelOptions(rpc=rpc, **placement))
    return {role: flags[role]["tensor_overrides"] for role in ("target", "draft")}


def _print_rpc_plan(target, rpc, rpc_mem, n_ctx, as_json):
    from .. import plan as planner
    from ..session import rpc_split
    shares, ngl = rpc_split(target, rpc, rpc_mem, n_ctx)
    tps = 1 / planner.rpc_token_seconds(target, shares, planner.detect_ram())
    if as_json:
        click.echo(json.dumps({"ngl": ngl, "tensor_split": [s.blocks for s in shares[1:]], "n_ctx": n_ctx,
                               "estimated": True, "predicted_target_alone_tps": tps,
                               "hosts": [asdict_(s) for s in shares]}))
        return
    click.echo(f"{'host':<24} {'blocks':>6} {'GiB':>8} {'free GiB':>9} {'rtt ms':>7}")
    for s in shares:
        click.echo(f"{s.host:<24} {s.blocks:>6} {s.bytes / planner.GiB:>8.2f} {s.free / planner.GiB:>9.2f} {s.rtt_ms:>7.2f}")
    click.echo(f"plan: -ngl {ngl} across {len(shares) - 1} worker(s), {target.n_layer + 1 - ngl} block(s) on this "
               f"CPU (estimated {tps:.1f} tok/s for the target alone)")


def asdict_(obj) -> dict:
    from dataclasses import asdict
    return asdict(obj)


@main.command(context_settings={"show_default": True})
@click.option("--host", default="127.0.0.1",
              help="Address to listen on. Workers are unauthenticated: beyond loopback only on a private network.")
@click.option("--port", default=50052, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("-t", "--threads", type=threads(), default=None, help="CPU threads [default: physical cores].")
@click.option("--mem", default=None, help="Memory a CPU worker offers to hosts, e.g. 24GiB [default: all its RAM].")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep large tensors received here, by hash: a restarted host loads faster.")
@friendly_errors
def worker(host, port, threads, mem, cache_dir):
    """Serve this machine's GPUs (else its CPU) to `ggufspec run|serve --rpc` (llama.cpp's RPC server)."""
    from ..plan import parse_size
    from ..rpc import start_worker
    if mem is not None and not mem.strip():  # `--mem=`: not "all its RAM" silently
        raise GgufspecError("--mem is empty: give the memory to offer, e.g. 24GiB (or leave --mem out: all its RAM)")
    start_worker(host, port, threads, parse_size(mem) if mem is not None else None, cache_dir)
