"""llama-server's LoRA endpoints over the target's adapters (`ggufspec.lora`).

GET /lora-adapters lists them in llama-server's shape. Their scales are fixed at start (--lora,
--lora-scaled): the slots share one llama context, where llama.cpp sets adapters per context, and every
slot's cached prefix was computed under those scales. So POST /lora-adapters and a request's `lora`
field are taken where they ask for the scales already set, and refused in one line otherwise."""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from ..lora import adapters_of
from .errors import APIError


def adapter_list(decoder) -> list[dict]:
    """[{id, path, scale, task_name, prompt_prefix}, ...]: llama-server's GET /lora-adapters."""
    return [{"id": i, "path": a.path, "scale": a.scale, "task_name": a.task_name, "prompt_prefix": a.prompt_prefix}
            for i, a in enumerate(adapters_of(decoder.target_llm))]


def check_scales(requested, decoder, param: str = "lora") -> None:
    """`requested` as llama-server reads it ([{"id": N, "scale": S}, ...], an adapter left out: scale 0)
    must be the scales the server was started with; else a 400 saying how to get others."""
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
        if not _is_number(scale):
            raise APIError(400, f"{param}: the scale of adapter {index} must be a number, got {scale!r}",
                           code="invalid_value", param=param)
        scales[index] = float(scale)
    current = [a.scale for a in adapters]
    if scales != current:
        raise APIError(400, f"{param}: LoRA scales are set at start here and do not change per request or later "
                            f"(now {current}, asked {scales}): start the server with --lora-scaled FNAME:SCALE",
                       code="unsupported_parameter", param=param)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def add_adapter_routes(app: FastAPI, decoder) -> None:
    """GET and POST /lora-adapters (behind the app's Guard, as every route but the page and /health)."""

    @app.get("/lora-adapters")
    async def lora_adapters():
        return adapter_list(decoder)

    @app.post("/lora-adapters")
    async def set_lora_adapters(request: Request):
        body = await request.body()
        try:
            requested = await asyncio.to_thread(json.loads, body)
        except ValueError:
            raise APIError(400, 'malformed JSON body: send [{"id": N, "scale": S}, ...]') from None
        check_scales(requested, decoder, "body")
        return {"success": True}
