"""`ggufspec serve`: an OpenAI-compatible HTTP API over one `SpeculativeDecoder`, which also speaks
Anthropic's Messages API and OpenAI's Responses API (protocols/: coding agents).

Each request sends its whole prompt (or conversation); the decoder keeps the longest prefix its KV
cache shares with it, so a conversation that grows turn by turn is only evaluated once.

`GET /` is a chat page (ggufspec/static/chat.html, self-contained) that shows the speculation: each
token coloured by origin, K per step, and the time saved against the target alone; `GET /props`
describes the pair for it (llama-server has an endpoint of that name).

One concern a module:
- app.py: `create_app`, the routes (thin: parse, submit, respond)
- guard.py: who may use them (Host names, CORS and origins, the API key) and the body cap, in one
  middleware (`Guard`) with its policy (`Exposure`); bodies parsed and validated off the event loop
- schemas.py: request bodies, and what they ask of the decoder (`request_options`, prompt, messages, stops)
- samplers.py: llama.cpp's `samplers` (the chain's order) and `adaptive_target`, as far as they map
- jobs.py: the `Engine` (one worker thread, one generation at a time, --max-queue, 429) and a request's `Job`
- progress.py: the stream's `return_progress` (prompt_progress chunks) and `timings_per_token`
- responses.py: OpenAI's response objects and stream chunks, `usage`, `timings`
- speculation.py: the `ggufspec` fields: each token's origin and step, the prompt's cache, the time saved
- props.py: GET /props, the pair as its models describe themselves
- errors.py: errors in OpenAI's shape (Anthropic's under /v1/messages: `error_body`) and the app's exception handlers
- protocols/: Anthropic's Messages and OpenAI's Responses, each a translation of the chat request and answer
- listen.py: the listening socket, uvicorn, a clean stop on Ctrl-C or SIGTERM
- supervisor.py: `serve --rpc`: the model in a child process, restarted when a lost or hung worker is back
- proxy.py: the supervisor's front: requests forwarded to that child, 503 (or an SSE error) while it is gone
The stop strings are `ggufspec.stops`, which `ggufspec eval` uses too.
"""
from .app import create_app

__all__ = ["create_app"]
