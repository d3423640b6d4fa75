"""llama.cpp's own routes, `/completion` (also `/completions`) and `/infill`, for the clients written
against llama-server: its editor plugins' code completion (llama.vim, llama.vscode: /infill), and
scripts that send `n_predict` and read `content`. The request is llama-server's (schemas.NativeBody);
the answer is its native object, not OpenAI's: content, tokens, stop, stop_type, stopping_word,
tokens_predicted / tokens_evaluated / tokens_cached, generation_settings, timings, and
completion_probabilities where n_probs asks. Streamed, one `data:` object per step's pieces
(stop: false), then the whole object with empty content and stop: true; no [DONE], as llama-server.
Its editor plugins' limits hold too: `n_indent` and `t_max_predict_ms` (stops.LineLimits).

/infill builds the fill-in-the-middle prompt (ggufspec.fim) from input_prefix, input_suffix,
input_extra and prompt, as llama-server does, and is then a /completion of those tokens: drafted,
constrained and cached like every answer."""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from ...sampling import LLAMACPP_FILTERS
from ...stats import Stats
from ..errors import APIError, engine_error
from ..jobs import Job
from ..progress import StreamExtras
from ..responses import probability_entry, timings
from ..schemas import NativeBody, completion_prompts, line_limits, single_prompt
from .core import Serving, answer_or_stream

STOP_TYPES = {"eos": "eos", "stop": "word", "n_predict": "limit", "context": "limit"}
SETTINGS = ("n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "n_draft", "draft_max", "draft_min",
            "draft_p_min", "drafter", "cache_prompt", *LLAMACPP_FILTERS)


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request, body: NativeBody):
        prompts = [await mixed_tokens(serving, p) for p in completion_prompts(body)]
        return await answer(serving, request, body, prompts)

    @app.post("/infill")
    async def infill(request: Request, body: NativeBody):
        for field in ("input_prefix", "input_suffix"):
            if getattr(body, field) is None:
                raise APIError(400, f"\"{field}\" is required", code="invalid_value")
        prompt = single_prompt(body)
        if not isinstance(prompt, str):
            raise APIError(400, "/infill's prompt is the text typed after input_prefix: a string, not token ids",
                           code="invalid_value")
        tokens = await serving.fim(body.input_prefix, body.input_suffix, status=501, prompt=prompt,
                                   extra=[chunk.model_dump() for chunk in body.input_extra],
                                   n_predict=serving.defaults.get("n_predict", -1))  # the server's: see fim_prompt
        return await answer(serving, request, body, [tokens])


async def mixed_tokens(serving: Serving, prompt):
    """llama-server's mixed prompt, token ids and texts in one list ([755, " add"]), as ids: the texts
    tokenized without BOS but the first element's (tokenize_mixed); any other prompt as it is."""
    if not (isinstance(prompt, list) and any(isinstance(part, str) for part in prompt)):
        return prompt

    def tokens() -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, int):
                ids.append(part)
            elif i == 0:
                ids += serving.decoder.tokenize(part)
            else:
                ids += serving.decoder.target_llm.tokenize(part.encode(), add_bos=False, special=True)
        return ids
    return await asyncio.to_thread(tokens)


async def answer(serving: Serving, request: Request, body: NativeBody, prompts: list):
    """llama-server's answer, one object per prompt (a list of them where several were sent: each
    streamed chunk says its `index`): n_predict as a ceiling the context lowers, not a demand it refuses."""
    serving.check_model(body.model)
    job = await serving.submit(body, prompts=prompts, n=body.n, fit_to_context=True, line_limits=line_limits(body))
    replies = NativeReplies(serving, job, body, prompts)
    return await answer_or_stream(job, request, body.stream, lambda n_prompt: replies.whole(request, n_prompt),
                                  replies.events)


class NativeReply:
    """llama-server's objects for one prompt's answer."""

    def __init__(self, serving: Serving, job: Job, body: NativeBody, prompt: str | list[int], index: int):
        self.serving, self.job, self.body, self.prompt, self.index = serving, job, body, prompt, index
        self.pieces: list[dict] = []
        self.n_prompt, self.id_slot = 0, -1

    def chunk(self, pieces: list[dict], stats: Stats | None = None) -> dict:
        """One step's pieces, streamed (their token ids whatever return_tokens says, as llama-server);
        with `stats`, the timings so far (timings_per_token)."""
        self.pieces += pieces
        return {"index": self.index, "content": "".join(p["text"] for p in pieces),
                "tokens": [p["token"] for p in pieces], "stop": False, "id_slot": self.id_slot,
                "tokens_predicted": len(self.pieces), "tokens_evaluated": self.n_prompt, **self.probabilities(pieces),
                **({"timings": timings(stats)} if stats is not None else {})}

    def progress_chunk(self, block: dict) -> dict:
        """llama-server's prompt processing progress (return_progress), before the first token."""
        return {"index": self.index, "content": "", "tokens": [], "stop": False, "id_slot": self.id_slot,
                "tokens_predicted": 0, "tokens_evaluated": block["total"], "prompt_progress": block}

    def final(self, stats: Stats, streamed: bool) -> dict:
        """The whole answer (streamed: its content and tokens went out already)."""
        content = "".join(p["text"] for p in self.pieces)
        return {"index": self.index, "content": "" if streamed else content,
                "tokens": [] if streamed else self.token_ids(self.pieces), "id_slot": stats.id_slot,
                "stop": True, "model": self.serving.model_name, "tokens_predicted": stats.n_predict,
                "tokens_evaluated": stats.n_prompt, "generation_settings": self.settings(),
                "prompt": self.prompt_text(), "has_new_line": "\n" in content, "truncated": False,
                "stop_type": STOP_TYPES.get(stats.stop_reason, "none"),
                "stopping_word": self.job.stop_sequences.get(self.index, ""),
                "tokens_cached": stats.n_prompt + stats.n_predict, "timings": timings(stats),
                **({} if streamed else self.probabilities(self.pieces))}

    def token_ids(self, pieces: list[dict]) -> list[int]:
        return [p["token"] for p in pieces] if self.body.return_tokens else []

    def probabilities(self, pieces: list[dict]) -> dict:
        """llama-server's completion_probabilities: each token's id, text, bytes, logprob and top_logprobs
        (with post_sampling_probs, prob and top_probs: the same distribution's probabilities)."""
        if self.job.shape.logprobs is None:  # n_probs (or its alias logprobs) not asked
            return {}
        entries = [{"id": p["token"], **p["logprobs"], "top_logprobs": [
            {"id": token, **top} for token, top in zip(p["top_ids"], p["logprobs"]["top_logprobs"])]}
            for p in pieces if "logprobs" in p]
        if self.body.post_sampling_probs:
            entries = [probability_entry(entry) for entry in entries]
        return {"completion_probabilities": entries}

    def settings(self) -> dict:
        options = self.job.options
        return {**{name: options[name] for name in SETTINGS if name in options}, "stop": self.job.stops,
                "n_probs": self.job.shape.logprobs or 0, "stream": self.body.stream,
                "lora": [{"id": i, "scale": scale} for i, scale in enumerate(self.job.lora or ())]}

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        text = self.serving.decoder.target.detokenize(self.prompt)
        return text.decode("utf-8", errors="replace")


class NativeReplies:
    """A job's events as llama-server's objects, one NativeReply per choice: `n` (n_cmpl) of each
    prompt, index i * n + j for prompt i's j-th, as llama-server numbers a prompt's completions."""

    def __init__(self, serving: Serving, job: Job, body: NativeBody, prompts: list):
        self.job, self.body = job, body
        self.replies = [NativeReply(serving, job, body, prompts[i // job.n], i) for i in range(job.n_choices)]
        self.ended: dict[int, Stats] = {}

    async def whole(self, request: Request, n_prompt: int):
        for reply in self.replies:
            reply.n_prompt = n_prompt
        while True:
            kind, value = await self.job.next_event(request)
            if kind == "pieces":
                self.replies[value[0]].pieces += value[1]
            elif kind == "choice":
                self.ended[value[0]] = value[1]
            elif kind == "done":
                answers = [picked(reply.final(self.ended.get(reply.index, value[0]), streamed=False),
                                  self.body.response_fields) for reply in self.replies]
                return answers[0] if len(answers) == 1 else answers
            elif kind == "error":
                raise engine_error(value)

    async def events(self, n_prompt: int):
        """SSE events; a client that goes away cancels the generation (`finally`)."""
        for reply in self.replies:
            reply.n_prompt = n_prompt
        extras = StreamExtras(self.job)  # prompt_progress and per-token timings, where asked
        try:
            while True:
                kind, value = await self.job.events.get()
                progress = extras.progress_of(kind, value)
                if kind == "prompt":
                    reply = self.replies[value[0]]
                    reply.id_slot, reply.n_prompt = value[1]["id_slot"], value[1]["n_prompt"]
                if progress is not None:
                    yield data(self.replies[progress[0]].progress_chunk(progress[1]))
                if kind == "pieces":
                    yield data(self.replies[value[0]].chunk(value[1], extras.stats_of(*value)))
                elif kind == "choice":
                    yield data(picked(self.replies[value[0]].final(value[1], streamed=True), self.body.response_fields))
                elif kind in ("done", "error"):
                    if kind == "error":
                        yield data(engine_error(value).body())
                    return
        finally:
            self.job.cancel()


def picked(answer: dict, fields: list[str] | None) -> dict:
    """llama-server's `response_fields`: only these fields, "a/b" naming b inside a (the key stays
    "a/b", as llama-server's json_get_nested_values keeps it); a field the answer lacks is left out."""
    if not fields:
        return answer
    found = {}
    for path in fields:
        value = answer
        for key in path.split("/"):
            value = value.get(key, KeyError) if isinstance(value, dict) else KeyError
        if value is not KeyError:
            found[path] = value
    return found


def data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}
