"""What a resumable stream costs (llama-server's X-Conversation-Id: the SSE bytes kept in a buffer by a task of
their own, the response reading them back), and what a dropped connection costs with it.

One `ggufspec serve` on the demo pair streams the same chat answer (greedy, the prompt evaluated whole each time:
cache_prompt false) alternately with and without the header, `--rounds` times each; reported per run: the wall
time, the time to the first content, the answer's tokens and decode speed (the final chunk's `timings`). Then
the client of a resumable stream leaves after `--leave-after` content chunks and reads the rest with
GET /v1/stream?from=<bytes read>: the whole answer's wall time, and whether its text is the uninterrupted one.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/resumable_stream.py --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_bench import Server, demo_pair, free_port, server_command  # noqa: E402

QUESTION = "Write a Python function that parses a CSV line with quoted fields, and explain it briefly."


def serve(folder: pathlib.Path, threads: int, draft: str) -> Server:
    """`ggufspec serve` on the demo pair with one slot and `--draft draft`, its log in `folder`."""
    target, draft_model = demo_pair()
    port = free_port()
    command = server_command("ggufspec", target, draft_model, threads, 4096, port) + ["-np", "1", "--draft", draft]
    return Server("ggufspec", command, port, folder / "server.log", ready_timeout=600)


def body(max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "cache_prompt": False}


def events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def text_of(raw: bytes) -> str:
    return "".join((e["choices"] or [{}])[0].get("delta", {}).get("content") or "" for e in events(raw))


def stream(url: str, max_tokens: int, conversation: str | None, leave_after: int | None = None) -> dict:
    """One streamed answer: wall time, first content, its bytes (cut after `leave_after` content chunks)."""
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    started, first, raw, contents = time.perf_counter(), None, b"", 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body(max_tokens), headers=headers,
                      timeout=900) as response:
        for chunk in response.iter_raw():
            raw += chunk
            if first is None and b'"content": "' in chunk:
                first = time.perf_counter() - started
            contents = raw.count(b'"content": "')
            if leave_after is not None and contents >= leave_after:
                break
    return {"wall_s": time.perf_counter() - started, "first_s": first, "raw": raw}


def measured(run: dict) -> dict:
    final = next((e for e in reversed(events(run["raw"])) if "timings" in e), {})
    timings = final.get("timings", {})
    return {"wall_s": round(run["wall_s"], 2), "first_s": round(run["first_s"] or 0, 2),
            "tokens": timings.get("predicted_n"), "decode_tps": round(timings.get("predicted_per_second", 0), 1),
            "n_drafted": timings.get("draft_n"), "n_accept": timings.get("draft_n_accepted"),
            "bytes": len(run["raw"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--leave-after", type=int, default=20, help="content chunks read before the client leaves")
    parser.add_argument("--json", dest="out", default=None)
    args = parser.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    with serve(folder, args.threads, args.draft) as server:
        url = server.url
        stream(url, 16, None)  # the step costs timed, the caches warm
        runs = {"plain": [], "resumable": []}
        texts = set()
        for i in range(args.rounds):
            for kind in ("plain", "resumable") if i % 2 == 0 else ("resumable", "plain"):
                run = stream(url, args.max_tokens, f"bench-{i}" if kind == "resumable" else None)
                runs[kind].append(measured(run))
                texts.add(text_of(run["raw"]))
        started = time.perf_counter()
        cut = stream(url, args.max_tokens, "bench-leave", leave_after=args.leave_after)
        rest = httpx.get(url + "/v1/stream", params={"conv_id": "bench-leave", "from": len(cut["raw"])}, timeout=900)
        resumed = {"wall_s": round(time.perf_counter() - started, 2), "bytes_before_leaving": len(cut["raw"]),
                   "same_text": text_of(cut["raw"] + rest.content) in texts, **{
                       k: v for k, v in measured({"wall_s": 0, "first_s": 0, "raw": rest.content}).items()
                       if k in ("tokens", "decode_tps")}}
    results = {"threads": args.threads, "draft": args.draft, "max_tokens": args.max_tokens, "runs": runs,
               "median_wall_s": {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()},
               "median_decode_tps": {k: statistics.median(r["decode_tps"] for r in v) for k, v in runs.items()},
               "same_text_every_run": len(texts) == 1, "left_and_resumed": resumed}
    print(json.dumps(results, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
