"""llama-server's flags for what ggufspec serve does otherwise, refused by name in one line that says why and
what to do instead (click's own answer would be a bare "No such option"). A pasted llama-server command
line thus fails at its first such flag, saying so, before anything loads. Where a flag's value or form
is what ggufspec does anyway (`-cram 0`, `--no-mmproj`, `--no-tools`...) it is taken."""
from __future__ import annotations

import click

from ..errors import GgufspecError

NO_MEDIA = "ggufspec serves text models; images and audio are not supported (serve a multimodal model with llama-server)"
NO_PROMPT_CACHE = ("ggufspec keeps each conversation in its slot's cache (its next turn goes back there) and shares "
                   "prefixes between slots; a conversation goes to disk with --slot-save-path")
NO_SERVER_TOOLS = "ggufspec runs no tools itself: a client's tools go in its request (tools, tool_choice)"
ONE_MODEL = "ggufspec serves one target (and its draft) per server: start one server per model"
NO_EMBEDDINGS = ("ggufspec serves generation with speculative decoding; for embeddings run llama-server --embeddings "
                 "with an embedding model")
NO_LOOKUP_FILES = ("ggufspec's n-gram lookup drafts from the conversation and an in-memory pool of earlier requests' "
                   "n-grams (--lookup-pool); it reads no llama.cpp n-gram cache files: leave it out")
OWN_CHECKPOINTS = "ggufspec checkpoints sliding-window and recurrent memory itself, where a rollback needs it; leave it out"
NO_CONTEXT_SHIFT = ("ggufspec does no context shift (an answer ends when the context is full, finish_reason "
                    "\"length\"), so no prompt tokens are kept through one; raise -c for longer answers")

# (flags, takes a value, what the flag's "it does nothing" value or negative form is, why not)
REFUSED = [
    (("-nocb", "--no-cont-batching"), False, None, "ggufspec's slots always decode together, one batch per step "
     "(continuous batching); for one request at a time give -np 1"),
    (("--no-cache-prompt",), False, None, "ggufspec always reuses the prefix a slot has cached (a request's answer "
     "says how much in timings.cache_n; a request's cache_prompt false evaluates its prompt whole)"),
    (("--cache-reuse",), True, "0", "ggufspec reuses the prefix a slot (or, on a KV cache, any slot) holds, never "
     "chunks moved within the cache (llama.cpp's KV shifting); leave it out"),
    (("-no-kvu", "--no-kv-unified"), False, None, "ggufspec's slots share one unified cache, as llama-server's "
     "default (--strict or --exact give each slot a cache of its own)"),
    (("--context-shift",), False, None, "ggufspec ends an answer when the context is full (finish_reason "
     "\"length\"), as llama-server without it; raise -c for longer ones"),
    (("--embedding", "--embeddings"), False, None, NO_EMBEDDINGS),
    (("--pooling",), True, None, NO_EMBEDDINGS),
    (("--embd-normalize",), True, None, NO_EMBEDDINGS),
    (("--rerank", "--reranking"), False, None, "ggufspec has no reranking endpoint; run llama-server --rerank"),
    (("-mm", "--mmproj"), True, None, NO_MEDIA),
    (("-mmu", "--mmproj-url"), True, None, NO_MEDIA),
    (("--mmproj-auto",), False, None, NO_MEDIA),
    (("--mmproj-offload",), False, None, NO_MEDIA),
    (("--media-path",), True, None, NO_MEDIA),
    (("--image-min-tokens",), True, None, NO_MEDIA),
    (("--image-max-tokens",), True, None, NO_MEDIA),
    (("--mtmd-batch-max-tokens",), True, None, NO_MEDIA),
    (("--video-fps",), True, None, NO_MEDIA),
    (("--video-timestamp-interval",), True, None, NO_MEDIA),
    (("--video-ffmpeg-dir",), True, None, NO_MEDIA),
    (("-cram", "--cache-ram"), True, "0", NO_PROMPT_CACHE),
    (("--cache-idle-slots",), False, None, NO_PROMPT_CACHE),
    (("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), True, None, OWN_CHECKPOINTS),
    (("-cms", "--checkpoint-min-step"), True, "8192", OWN_CHECKPOINTS),
    (("--kv-unified-per-slot",), True, None,
     "ggufspec's slots share -c's cells (one unified cache, llama-server's default), each answer ending when the "
     "context is full: give -c N times -np instead"),
    (("--keep",), True, "0", NO_CONTEXT_SHIFT),
    (("-lcs", "--lookup-cache-static"), True, None, NO_LOOKUP_FILES),
    (("-lcd", "--lookup-cache-dynamic"), True, None, NO_LOOKUP_FILES),
    (("--spec-draft-p-split", "--draft-p-split"), True, "0.1",
     "ggufspec drafts one line of proposals, never a tree of them, so nothing splits: leave it out"),
    (("--spec-synth-len",), True, None,
     "ggufspec verifies real drafts only; to see speed under another acceptance, `ggufspec plan --trace FILE` "
     "simulates recorded acceptance traces"),
    (("--spec-synth-rates",), True, None,
     "ggufspec verifies real drafts only; to see speed under another acceptance, `ggufspec plan --trace FILE` "
     "simulates recorded acceptance traces"),
    (("--spm-infill",), False, None,
     "ggufspec's /infill writes the model's FIM tokens in prefix-suffix-middle order, the order its FIM models "
     "(Qwen2.5-Coder, CodeLlama...) were trained on; leave it out"),
    (("-cl", "--cache-list"), False, None, "`ggufspec list` shows the models in ggufspec's store"),
    (("--completion-bash",), False, None,
     "ggufspec's shell completion is click's: eval \"$(_GGUFSPEC_COMPLETE=bash_source ggufspec)\""),
    (("--sleep-idle-seconds",), True, "-1", "ggufspec keeps the models loaded while it serves; stop it to free them"),
    (("--models-dir",), True, None, ONE_MODEL),
    (("--models-preset",), True, None, ONE_MODEL),
    (("--models-max",), True, None, ONE_MODEL),
    (("--models-autoload",), False, None, ONE_MODEL),
    (("--tools",), True, None, NO_SERVER_TOOLS),
    (("--tools-runtime",), True, None, NO_SERVER_TOOLS),
    (("--mcp-servers-config",), True, None, NO_SERVER_TOOLS),
    (("--mcp-servers-json",), True, None, NO_SERVER_TOOLS),
    (("-ag", "--agent"), False, None, NO_SERVER_TOOLS),
    (("--ui-mcp-proxy", "--webui-mcp-proxy"), False, None, NO_SERVER_TOOLS),
    (("--ui-config", "--webui-config"), True, None, "ggufspec's chat page takes no configuration; leave it out"),
    (("--ui-config-file", "--webui-config-file"), True, None,
     "ggufspec's chat page takes no configuration; leave it out"),
    (("--path",), True, None, "ggufspec serves its own chat page at / (--no-webui: none); serve other files elsewhere"),
    (("--cors-methods",), True, None, "ggufspec's CORS answers GET, POST and OPTIONS for --cors-origins; leave it out"),
    (("--cors-headers",), True, None, "ggufspec's CORS allows the headers its API reads; leave it out"),
    (("--cors-credentials",), False, None, "ggufspec's CORS never allows credentials; leave it out"),
]
# negative forms that ask for what ggufspec does anyway
TAKEN = ("-cb", "--cont-batching", "--cache-prompt", "--no-context-shift", "--no-mmproj", "--no-mmproj-auto",
         "--no-mmproj-offload", "--no-cache-idle-slots", "--no-models-autoload", "--no-spm-infill", "-no-ag",
         "--no-agent", "--no-ui-mcp-proxy", "--no-webui-mcp-proxy", "--no-cors-credentials")


def refusal_options(table, taken: tuple[str, ...] = (), multiple: tuple[str, ...] = ()) -> list:
    """Hidden options for a table of refusals, rows (flags, takes a value, the value that does nothing or
    None, why): each flag, and `taken` (forms that ask for what ggufspec does anyway) as one option;
    the flags in `multiple` may be given several times (their values joined when refused)."""
    made = []
    for flags, takes_value, _, _ in table:
        if takes_value:
            made.append(click.option(*flags, _name(flags), default=None, hidden=True, multiple=flags[0] in multiple))
        else:
            made.append(click.option(*flags, _name(flags), is_flag=True, default=False, hidden=True))
    if taken:
        made.append(click.option(*taken, "taken_negatives", is_flag=True, default=False, hidden=True))
    return made


def refuse_given(table, opts: dict, where: str = "") -> None:
    """The table's flags (consumed from `opts`, with the taken forms): the first one given, but at its
    value that does nothing, raises GgufspecError saying why; `where`: " on run"..."""
    opts.pop("taken_negatives", None)
    for flags, takes_value, harmless, why in table:
        value = opts.pop(_name(flags))
        if isinstance(value, tuple):  # a flag given once per value (--image '' is given too)
            value = ",".join(value) if value else None
        given = value is not None if takes_value else value
        if given and not (takes_value and harmless is not None and _same(str(value).strip(), harmless)):
            shown = "/".join(flags) + (f" {value or repr(value)}" if takes_value else "")
            raise GgufspecError(f"{shown} is not supported{where}: {why}")


def unsupported_options() -> list:
    """serve's: each refused flag, and the negative forms taken."""
    return refusal_options(REFUSED, TAKEN)


def refuse_unsupported(opts: dict) -> None:
    refuse_given(REFUSED, opts)


def serve_reason(flag: str) -> str:
    """serve's reason for refusing `flag`, for the commands it holds for too."""
    return next(why for flags, _, _, why in REFUSED if flag in flags)


def _name(flags: tuple[str, ...]) -> str:
    return "refused_" + max(flags, key=len).lstrip("-").replace("-", "_")


def _same(value: str, harmless: str) -> bool:
    """The value given is the one that does nothing (0.10 is 0.1)."""
    try:
        return float(value) == float(harmless)
    except ValueError:
        return value == harmless
