"""llama-server's LoRA endpoints and a request's `lora` field over the target's adapters (`ggufspec.lora`).

GET /lora-adapters lists them in llama-server's shape, with the scales a request without `lora` runs
under: those set at start (--lora, --lora-scaled) until POST /lora-adapters sets others. A request's
`lora` field gives its own. The slots share one llama context, where llama.cpp sets adapters per context,
so a generation under other scales than the context's waits until no slot runs, and the scales change
with every cached cell dropped (`Slots._take_scaled`): generations under equal scales run together, as
llama-server batches only slots with equal adapters."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..errors import GgufspecError
from ..lora import adapters_of, check_rescale_exact
from .errors import APIError, json_body


def adapter_list(decoder, scales) -> list[dict]:
    """[{id, path, scale, task_name, prompt_prefix}, ...]: llama-server's GET /lora-adapters."""
    return [{"id": i, "path": a.path, "scale": scale, "task_name": a.task_name, "prompt_prefix": a.prompt_prefix}
            for i, (a, scale) in enumerate(zip(adapters_of(decoder.target_llm), scales))]


def requested_scales(requested, decoder, param: str = "lora") -> tuple[float, ...]:
    """`requested` as llama-server reads it ([{"id": N, "scale": S}, ...], an adapter left out: scale 0)
    as one scale per adapter; a 400 where it is not that shape or names no adapter of this server."""
    adapters = adapters_of(decoder.target_llm)
    if not isinstance(requested, list) or not all(isinstance(entry, dict) for entry in requested):
        raise APIError(400, f'{param} must be a list of {{"id": N, "scale": S}} objects (GET /lora-adapters '
                            f'lists the ids)', code="invalid_value", param=param)
    scales = [0.0] * len(adapters)
    for entry in requested:
        index, scale = entry.get("id"), entry.get("scale", 0.0)
        if not _is_int(index) or not 0 <= index < len(adapters):
            raise APIError(400, f"{param}: no LoRA adapter has id {index!r} (this server has {len(adapters)}: "
                                f"GET /lora-adapters)", code="invalid_value", param=param)
        if not _is_number(scale) or scale != scale or abs(scale) == float("inf"):
            raise APIError(400, f"{param}: the scale of adapter {index} must be a finite number, got {scale!r}",
                           code="invalid_value", param=param)
        scales[index] = float(scale)
    try:  # as at start: --exact refuses what it cannot keep exact
        check_rescale_exact(decoder.target_llm, scales, getattr(decoder, "verification", "batch"))
    except GgufspecError as exc:
        raise APIError(400, f"{param}: {exc}", code="unsupported_parameter", param=param) from None
    return tuple(scales)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def add_adapter_routes(app: FastAPI, decoder, engine) -> None:
    """GET and POST /lora-adapters (behind the app's Guard, as every route but the page and /health)."""

    @app.get("/lora-adapters")
    async def lora_adapters():
        return adapter_list(decoder, engine.lora_scales)

    @app.post("/lora-adapters")
    async def set_lora_adapters(request: Request):
        requested = await asyncio.to_thread(json_body, await request.body(), '[{"id": N, "scale": S}, ...]')
        engine.lora_scales = requested_scales(requested, decoder, "body")  # for the requests from now on
        return {"success": True}
