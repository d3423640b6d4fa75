"""llama-server's flags that `serve` takes as users paste them from its command lines and docs
(common/arg.cpp, LLAMA_EXAMPLE_SERVER): each one does here what it does there, or, where ggufspec
has no such behaviour, is refused in one line that says what ggufspec does instead. None is taken
and ignored."""
from __future__ import annotations

import click

from ..errors import GgufspecError
from .bounds import INT32_MAX, AtMost, FiniteRange
from .options import options
from .unsupported_flags import refuse_unsupported, unsupported_options

DEFAULT_TIMEOUT_S = 3600  # llama-server's (common.h); the same as server.front's


def llamacpp_server_options(command):
    """The options, in the order --help lists them; the hidden ones are accepted for what ggufspec
    always does, or refused (`server_flags`)."""
    hidden_flag = dict(is_flag=True, hidden=True, default=False)
    return options(
        click.option("--webui/--no-webui", "--ui/--no-ui", "webui", default=True,
                     help="The chat page at / (--no-webui: GET / is a 404, as llama-server's; the API the same)."),
        click.option("--api-prefix", "api_prefix", default="", metavar="PREFIX",
                     help="Serve every route under this path, e.g. /llm: the API at /llm/v1, the page at /llm/."),
        click.option("-to", "--timeout", "timeout", type=AtMost(1, INT32_MAX, "llama.cpp's int"), default=DEFAULT_TIMEOUT_S,
                     metavar="N", help="llama-server's read/write timeout, in seconds, as far as uvicorn keeps it: a "
                     "request body pausing longer gets 408, a client taking no answer data this long is cut off "
                     "(request headers and idle keep-alive follow uvicorn's own limits)."),
        click.option("--slots/--no-slots", "slots_endpoint", default=True,
                     help="Answer GET /slots (--no-slots: 501, as llama-server's)."),
        click.option("--slot-save-path", "slot_save_path", default=None, metavar="DIR",
                     help="Answer POST /slots/ID?action=save|restore|erase: a slot's cached conversation to a "
                          "file in DIR and back (the target's cache; the draft's in FILE.draft)."),
        click.option("--props", "props_endpoint", is_flag=True,
                     help="Answer POST /props (llama-server's: it changes nothing, {\"success\": true}); else 501."),
        click.option("--threads-http", "threads_http", type=AtMost(1, INT32_MAX, "llama.cpp's int"), default=None, metavar="N",
                     help="Threads for the HTTP side's work off its event loop (tokenizing, parsing bodies, slot "
                          "files) [default: Python's]; generations run in one thread per slot (-np)."),
        click.option("--sse-ping-interval", "sse_ping_interval", default=30, metavar="N",
                     type=AtMost(-1, INT32_MAX, "llama.cpp's int"),
                     help="Seconds between a stream's keep-alive pings (-1: none), as llama-server's; a request's "
                          "sse_ping_interval over it."),
        click.option("--reuse-port", "reuse_port", is_flag=True,
                     help="Let several servers listen on the same port (SO_REUSEPORT; the kernel spreads clients)."),
        click.option("-sps", "--slot-prompt-similarity", "prompt_similarity", type=FiniteRange(0, 1),
                     default=0.1, metavar="F",
                     help="A free slot's cached conversation is cut back to serve a new prompt only where it holds "
                          "more than this share of it (0: only a conversation's own next turn goes back to its "
                          "slot); where the slots share one cache (the default) a prompt takes its prefix from any."),
        click.option("--warmup/--no-warmup", "warmup", default=True,
                     help="Time the step costs for --draft auto before serving (--no-warmup: the first request "
                          "that needs them times them)."),
        click.option("-r", "--reverse-prompt", "reverse_prompts", multiple=True, metavar="PROMPT",
                     help="A stop string of every request that gives none (repeatable), as llama-server's."),
        click.option("--tags", "model_tags", default=None, metavar="TAG1,TAG2,...",
                     help="The model's tags, comma-separated, in /v1/models' `tags` (informational, llama-server's)."),
        click.option("--prefill-assistant/--no-prefill-assistant", "prefill_assistant", default=True,
                     help="A chat whose last message is the assistant's: the answer continues it (a prefill; the "
                          "answer is what follows it). --no-prefill-assistant: that message is a whole turn and "
                          "the answer a new one (a request's continue_final_message still continues it)."),
        click.option("--reasoning-preserve/--no-reasoning-preserve", "reasoning_preserve", default=None,
                     help="The chat template's preserve_reasoning variable (and preserve_thinking, clear_thinking... "
                          "derived from it): earlier turns' thinking kept in the prompt, by templates that read it "
                          "[default: on, as llama-server's; a request's chat_template_kwargs over it]."),
        click.option("--skip-chat-parsing/--no-skip-chat-parsing", "skip_chat_parsing", default=False,
                     help="Chat answers as the model wrote them: its thinking and tool calls left in the content, "
                          "not parsed into reasoning_content and tool_calls (grammars still apply)."),
        click.option("-sp", "--special", "special", is_flag=True,
                     help="Control tokens in answers as their text (<|im_start|>...), where they are otherwise left "
                          "out, as llama-server's -sp."),
        click.option("--lora-init-without-apply", "lora_init_without_apply", is_flag=True,
                     help="Load the --lora adapters at scale 0: requests without a `lora` field run without them "
                          "until POST /lora-adapters sets their scales (llama-server's)."),
        click.option("-kvu", "--kv-unified", "kv_unified", **hidden_flag),  # what ggufspec does, but under --strict
        *unsupported_options(),  # llama-server's flags for what ggufspec does otherwise: refused, saying why
    )(command)


def server_flags(opts: dict) -> dict:
    """The llama-server flags (consumed from `opts`), checked: a refused one raises GgufspecError. The
    values the server needs, by name (`chat`: its rules for chat requests, server.chatturn.ChatSettings)."""
    from ..server.chatturn import ChatSettings
    from .llamacli_flags import reverse_prompts
    from ..server.front import Endpoints, Front, check_api_prefix, check_slot_save_path
    refuse_unsupported(opts)
    if opts.pop("kv_unified") and (opts.get("strict") or opts.get("exact")):
        raise GgufspecError("-kvu/--kv-unified: with --strict or --exact each slot has a cache of its own; leave "
                            "one of them out")
    front = Front(api_prefix=check_api_prefix(opts.pop("api_prefix")), timeout=opts.pop("timeout"))
    endpoints = Endpoints(webui=opts.pop("webui"), slots=opts.pop("slots_endpoint"),
                          slot_save_path=check_slot_save_path(opts.pop("slot_save_path")),
                          props=opts.pop("props_endpoint"), threads_http=opts.pop("threads_http"),
                          sse_ping_interval=opts.pop("sse_ping_interval"))
    chat = ChatSettings(prefill_assistant=opts.pop("prefill_assistant"),
                        skip_chat_parsing=opts.pop("skip_chat_parsing"), preserve_reasoning=opts.pop("reasoning_preserve"))
    return {"front": front, "endpoints": endpoints, "reuse_port": opts.pop("reuse_port"), "warmup": opts.pop("warmup"),
            "prompt_similarity": opts.pop("prompt_similarity"), "chat": chat, "tags": model_tags(opts.pop("model_tags")),
            "stops": reverse_prompts(opts.pop("reverse_prompts")), "special": opts.pop("special"),
            "lora_off": opts.pop("lora_init_without_apply")}


def model_tags(text: str | None) -> tuple[str, ...]:
    """--tags' list: each stripped, empty ones left out (llama.cpp's string_split and strip)."""
    return tuple(tag.strip() for tag in (text or "").split(",") if tag.strip())
