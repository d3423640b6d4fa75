"""POST /v1/chat/completions/control (llama-server's): a running chat completion's thinking ended from
outside it, while its client still reads the answer. The completion armed it with `"reasoning_control":
true`; `{"id": its id, "action": "reasoning_end"}` then forces the budget message and </think> from the
next token the target decides (`thinking.ReasoningControl`), and the model goes on to its answer.

llama-server's answers: a missing id or an unknown action is a 400; otherwise {"success": true}, or
{"success": false, "message"} for an id that names no running completion (finished ones included) or
one that did not arm the control."""
from __future__ import annotations

import threading
import weakref

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from ..thinking import ReasoningControl
from .errors import APIError
from .jobs import Job

ACTIONS = ("reasoning_end",)


class ControlBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    action: str | None = None
    model: str | None = None  # llama-server's router picks the model by it; one model here


class Controls:
    """The running chat completions, by id, with the control each armed (None: not armed)."""

    def __init__(self):
        self._running: dict[str, tuple[weakref.ref, ReasoningControl | None]] = {}
        self._lock = threading.Lock()

    def add(self, completion_id: str, job: Job, control: ReasoningControl | None) -> None:
        with self._lock:
            self._running = {cid: entry for cid, entry in self._running.items() if _live(entry[0]())}
            self._running[completion_id] = (weakref.ref(job), control)

    def act(self, completion_id: str, action: str) -> dict:
        with self._lock:
            job_ref, control = self._running.get(completion_id, (lambda: None, None))
        if not _live(job_ref()):
            return {"success": False, "message": "no active completion for this id"}
        if control is None:
            return {"success": False, "message": "reasoning control not enabled for this completion"}
        control.request_end()
        return {"success": True}


def _live(job: Job | None) -> bool:
    """A job is over once its answer went out (whole or streamed) or its client left: it is cancelled then."""
    return job is not None and not job.cancelled.is_set()


def add_routes(app: FastAPI, controls: Controls) -> None:
    @app.post("/v1/chat/completions/control")
    async def control(body: ControlBody):
        if not body.id:
            raise APIError(400, "missing completion id", param="id")
        if body.action not in ACTIONS:
            raise APIError(400, f"unknown control action {body.action!r} (llama-server's: reasoning_end)",
                           param="action")
        return controls.act(body.id, body.action)
