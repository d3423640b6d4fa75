"""The app: the server's own routes (health, slots, props, models, tokenize, the chat page) and each
API's (`protocols`: HTTP to jobs, jobs to the API's JSON). The routes only parse, submit and hand over;
`guard.Guard` in front of them decides who may use them."""
from __future__ import annotations

import asyncio
import sys
import time
from importlib import resources

from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles

from .. import load
from .. import tools as toolkit
from . import protocols
from .adapters import add_adapter_routes
from .chatturn import ChatSettings
from .errors import APIError, add_error_handlers, json_body
from .front import Endpoints, Front
from .guard import Exposure, Guard, OffLoopRoute
from .jobs import Engine
from .props import chat_props, pair_props, system_fingerprint
from .resumable import add_stream_routes
from .tokens import DetokenizeBody, TokenizeBody, detokenize_tokens, tokenize_text


# The chat page's own script and style are inline; an answer's Markdown may not load anything from
# elsewhere (a remote image's address could carry the conversation away), and no other site may frame
# the page (which holds the API key).
PAGE_POLICY = {"Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                                          "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                          "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                                          "form-action 'none'",
               "X-Frame-Options": "DENY"}


def chat_page() -> str:
    return resources.files("ggufspec").joinpath("static", "chat.html").read_text(encoding="utf-8")


def create_app(decoder, *, model_name: str, defaults: dict | None = None, api_key: str | None = None,
               max_queue: int = 16, aliases: tuple[str, ...] = (), info: dict | None = None,
               session=None, exposure: Exposure | None = None, metrics: bool = False,
               template_defaults: dict | None = None, reasoning_format: str = "auto",
               endpoints: Endpoints | None = None, front: Front | None = None,
               chat: ChatSettings | None = None, tags: tuple[str, ...] = (), stops: tuple[str, ...] = (),
               special: bool = False, lora_off: bool = False) -> FastAPI:
    """The OpenAI-compatible app over `decoder`. `defaults`: stream() keywords from the command line.
    `exposure`: who may use it and how large a body may be (`guard`); without it, `api_key` and the
    defaults (no Host check: where it listens is not known here).
    `aliases`: other model ids accepted in requests (file names). `info`: shown in /v1/models' meta.
    `session`: the opened session, for /props (its `draft_choice`, where it has one). `metrics`: answer
    /metrics (llama-server's --metrics). `template_defaults`: every chat request's template variables
    (--chat-template-kwargs); `reasoning_format`: where chat answers put a reasoning model's thinking.
    `endpoints`: llama-server's optional ones (the page, /slots and its actions, POST /props); `front`:
    --api-prefix and --timeout, in front of the Guard (None: behind `serve --rpc`'s front, or none); `chat`:
    --prefill-assistant, --reasoning-preserve, --skip-chat-parsing; `tags`: --tags, shown in /v1/models; `stops`: -r, the stop strings of a request that gives none;
    `special`: -sp, control tokens in answers as their text; `lora_off`: --lora-init-without-apply, the
    adapters' scales 0 for requests without `lora` until POST /lora-adapters sets others."""
    engine = Engine(decoder, max_queue)
    engine.special = special
    if lora_off:
        engine.lora_scales = (0.0,) * len(engine.lora_scales)
    template = load.chat_template(decoder.target_llm)
    tool_format = toolkit.detect_format(template.text)
    if template.fallback:
        sys.stderr.write("ggufspec: warning: the target model has no chat template; chat requests are "
                         "rendered as ChatML (/props says \"chat_template_fallback\": true)\n")
    defaults = dict(defaults or {})
    accepted_models = {model_name, *aliases}
    created = int(time.time())
    endpoints = endpoints or Endpoints()
    decodes = decoder.slots.decode_counts() if metrics else None  # the target's llama_decode calls

    async def lifespan(app):
        if endpoints.threads_http:  # asyncio.to_thread's pool: tokenizing, parsing bodies, slot files
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(endpoints.threads_http, thread_name_prefix="ggufspec-http"))
        yield
        app.state.streams.cancel_all()  # resumable streams nobody may read any more
        await asyncio.to_thread(engine.close)  # stops the running generation within a step

    app = FastAPI(title="ggufspec", lifespan=lifespan)
    app.router.redirect_slashes = False  # a path with a trailing slash is a 404 in the API's shape, not a bare 307
    app.state.engine = engine
    app.add_middleware(Guard, exposure=exposure or Exposure(api_key=api_key))  # Host, CORS, origin, key, body cap
    app.router.route_class = OffLoopRoute  # request bodies parsed and validated off the event loop
    add_error_handlers(app)
    if front is not None:
        front.add_to(app)  # outside the Guard: it sees the paths without the prefix

    # OpenAI's chat and completions, Anthropic's Messages, OpenAI's Responses: the same requests to the same engine
    fingerprint = system_fingerprint(decoder, lora=engine.lora_scales)  # of requests without `lora`
    serving = protocols.Serving(engine, decoder, tool_format, defaults, model_name, accepted_models,
                                fingerprint=fingerprint, template_defaults=dict(template_defaults or {}),
                                reasoning_format=reasoning_format, sse_ping_interval=endpoints.sse_ping_interval,
                                chat=chat or ChatSettings(), default_stops=stops, start_lora=engine.lora_scales)
    protocols.add_routes(app, serving)
    add_stream_routes(app)  # GET/DELETE /v1/stream, POST /v1/streams/lookup: X-Conversation-Id's streams

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        last = engine.last and {"n_predict": engine.last.n_predict, "stop_reason": engine.last.stop_reason}
        n_busy = engine.slots.n_busy
        return {"status": "ok", "model": model_name, "busy": engine.busy, "waiting": engine.waiting, "last": last,
                "stalled_s": round(engine.stalled_seconds, 3), "slots_idle": len(engine.slots) - n_busy,
                "slots_processing": n_busy}

    @app.get("/metrics")
    async def metrics_endpoint():
        """llama-server's Prometheus metrics (`metrics.Metrics`), where the server was started with --metrics."""
        if not metrics:
            raise APIError(501, "this server does not answer /metrics: start it with --metrics", "not_supported_error")
        text = engine.metrics.prometheus(requests_processing=engine.running, requests_deferred=engine.waiting,
                                         decodes=decodes)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4",
                                 headers={"Process-Start-Time-Unix": str(engine.metrics.started)})

    add_slot_routes(app, engine, endpoints)
    add_adapter_routes(app, decoder, engine)  # GET and POST /lora-adapters: the scales of requests without `lora`
    props = {**pair_props(decoder, model_name, defaults),  # read once, before the worker runs anything
             **chat_props(template, tool_format, session, decoder), "system_fingerprint": fingerprint,
             "endpoint_slots": endpoints.slots, "endpoint_props": endpoints.props, "endpoint_metrics": metrics,
             "ui": endpoints.webui,
             # the template's <think> block: known, and opened by its assistant turn (the answer starts inside)
             "chat_template_thinking": dict(zip(("block", "opened_by_template"), serving.thinking))}

    if endpoints.webui:  # --no-webui: no page (GET / is a 404, as llama-server's), the API the same
        @app.get("/", response_class=HTMLResponse)
        async def page():
            return HTMLResponse(chat_page(), headers={"Cache-Control": "no-cache", **PAGE_POLICY})

        # the chat page's Markdown renderer and sanitiser (marked, DOMPurify), shipped with the package
        app.mount("/static", StaticFiles(packages=[("ggufspec", "static")]), name="static")

    @app.get("/props")
    async def props_endpoint():  # the fingerprint of requests without `lora` follows POST /lora-adapters
        return {**props, "system_fingerprint": serving.fingerprint_for(engine.lora_scales or None)}

    @app.post("/props")
    async def change_props():
        """llama-server's POST /props (with --props): it changes nothing there either, and says so."""
        if not endpoints.props:
            raise APIError(501, "This server does not support changing global properties. Start it with --props",
                           "not_supported_error")
        return {"success": True}

    def model_entry() -> dict:
        meta = {"n_ctx": decoder.n_ctx, **(info or {})}
        # OpenAI's fields and Anthropic's at once (each SDK reads its own)
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ggufspec", "meta": meta,
                "aliases": sorted(accepted_models - {model_name}), "tags": list(tags),
                **protocols.anthropic_model(model_name, created)}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        return {"object": "list", "data": [model_entry()], "has_more": False, "first_id": model_name,
                "last_id": model_name}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """One model (`client.models.retrieve`, either SDK), by any name a request may use for it."""
        serving.check_model(model_id)
        return model_entry()

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeBody):
        return await asyncio.to_thread(tokenize_text, decoder, body)

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeBody):
        return await asyncio.to_thread(detokenize_tokens, decoder, body)

    return app


def add_slot_routes(app: FastAPI, engine, endpoints: Endpoints) -> None:
    """GET /slots (unless --no-slots) and POST /slots/{id}?action=save|restore|erase (--slot-save-path),
    in llama-server's request and answer shapes."""
    from .slotfiles import ACTIONS, slot_action

    @app.get("/slots")
    async def slots(fail_on_no_slot: str | None = None):
        """Each slot, as llama-server's /slots: whether it generates, what its cache holds, its last answer."""
        if not endpoints.slots:
            raise APIError(501, "This server does not support slots endpoint. Start it without --no-slots",
                           "not_supported_error")
        if fail_on_no_slot and engine.slots.n_busy == len(engine.slots):
            raise APIError(503, "no slot available", "unavailable_error", "no_slot_available")
        return engine.slots.describe()

    @app.post("/slots/{id_slot}")
    async def slot_file(id_slot: str, request: Request, action: str | None = None):
        if endpoints.slot_save_path is None:
            raise APIError(501, "This server does not support slots action. Start it with --slot-save-path DIR",
                           "not_supported_error")
        if not (id_slot.isascii() and id_slot.isdigit() and len(id_slot) < 10):
            raise APIError(400, f"Invalid slot ID: {id_slot!r}", param="id_slot")
        if action not in ACTIONS:
            raise APIError(400, f"Invalid action: {action!r} (action=save, restore or erase)", param="action")
        body = await request.body()
        fields = json_body(body, '{"filename": "NAME"}') if body.strip() else {}
        filename = fields.get("filename") if isinstance(fields, dict) else None
        return await asyncio.to_thread(slot_action, engine.slots, int(id_slot), action, endpoints.slot_save_path,
                                       filename)
