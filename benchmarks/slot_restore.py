"""A long conversation's cache kept across a server restart (llama-server's --slot-save-path and
POST /slots/ID?action=save|restore), against evaluating its prompt again.

One `ggufspec serve` reads a long prompt (a source file and a question, through /v1/chat/completions) and
saves slot 0 (the target's cache, and the draft's in FILENAME.draft); it stops. A fresh server then answers
a follow-up turn three times: cold (its cache empty), after restoring the target's file alone (the draft
file moved away: the draft has the whole conversation to catch up on), and after restoring both.
Reported for each: the first-token time (the wall time of a 1-token answer), then, the slot set up the
same way again, a longer answer's prompt and decode times, its drafts made and kept, and its text; the
save and restore times and the file sizes; whether the texts are the same (greedy).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/slot_restore.py --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_bench import Server, demo_pair, free_port, server_command  # noqa: E402


def serve(folder: pathlib.Path, threads: int, draft: str) -> Server:
    """`ggufspec serve` on the demo pair with one slot and `--draft draft`, its slot files and log in `folder`."""
    target, draft_model = demo_pair()
    port = free_port()
    command = server_command("ggufspec", target, draft_model, threads, 4096, port)
    command += ["-np", "1", "--draft", draft, "--slot-save-path", str(folder)]
    return Server("ggufspec", command, port, folder / f"server-{time.monotonic_ns()}.log", ready_timeout=600)


def ask(url: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    started = time.perf_counter()
    answer = httpx.post(url + "/v1/chat/completions", timeout=900, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0}).json()
    return answer, time.perf_counter() - started


def slot(url: str, action: str) -> dict:
    return httpx.post(f"{url}/slots/0?action={action}", json={"filename": "conversation.bin"}, timeout=300).json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32, help="the first turn's answer")
    parser.add_argument("--answer-tokens", type=int, default=128, help="the follow-up's longer answer")
    parser.add_argument("--draft", default="auto", help="the servers' --draft (3: the draft reads every prompt)")
    parser.add_argument("--json", dest="out", default=None)
    args = parser.parse_args()
    source = pathlib.Path(__file__).with_name("agent_bench.py").read_text()[:6000]
    first = [{"role": "user", "content": f"Here is a file:\n```python\n{source}\n```\nWhat does it measure?"}]
    folder = pathlib.Path(tempfile.mkdtemp())
    with serve(folder, args.threads, args.draft) as server:
        answer, _ = ask(server.url, first, args.max_tokens)
        saved = slot(server.url, "save")
    turn = first + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Which function starts the server?"}]
    longer = turn[:-1] + [{"role": "user", "content": "Write a unit test for the function `chat`."}]
    results = {"prompt_tokens": answer["usage"]["prompt_tokens"], "file_bytes": saved["n_written"],
               "draft": args.draft, "n_saved_draft": saved["n_saved_draft"],
               "draft_file_bytes": draft_file.stat().st_size if (draft_file := folder / "conversation.bin.draft").exists() else 0,
               "save_ms": saved["timings"]["save_ms"]}
    for case in ("cold", "restored-target-only", "restored"):
        if case == "restored-target-only" and draft_file.exists():
            draft_file.rename(folder / "aside")
        # a fresh server each time: nothing cached but the files
        with serve(folder, args.threads, args.draft) as server:
            action = "erase" if case == "cold" else "restore"
            restored = slot(server.url, action)
            _, first_token = ask(server.url, turn, 1)
            slot(server.url, action)
            reply, wall = ask(server.url, longer, args.answer_tokens)
        timings = reply["timings"]
        results[case] = {"first_token_s": round(first_token, 2), "restore": restored,
                         "answer_s": round(wall, 2), "prompt_ms": round(timings["prompt_ms"]),
                         "cache_n": timings.get("cache_n"), "prompt_n": timings["prompt_n"],
                         "predicted_n": timings["predicted_n"], "predicted_ms": round(timings["predicted_ms"]),
                         "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted"),
                         "text": reply["choices"][0]["message"]["content"]}
        if (folder / "aside").exists():
            (folder / "aside").rename(draft_file)
    results["same_text"] = len({results[case]["text"] for case in ("cold", "restored-target-only", "restored")}) == 1
    print(json.dumps(results, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
