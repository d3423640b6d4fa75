"""Speculation on a recurrent (Mamba) target: --no-draft vs --draft K vs auto, interleaved, with the
target tokens each evaluated (rollback restores a saved state and re-evaluates only kept tokens).

    .venv/bin/python benchmarks/memory_bench.py [--tokens 256] [--rounds 5] [--n-embd 256 --layers 8]
        [--llama-server third_party/llama.cpp/build/bin/llama-server]

With --llama-server, llama.cpp's server runs the same files in the same rounds: the target alone, and
`-md DRAFT --spec-type draft-simple --spec-draft-n-max K` for each K (scripts/build-llamacpp.sh builds it).

The models are written at run time with the `gguf` package (ggufspec/tinymodels.py: a Mamba target and
its first 2 layers as the draft). Each round runs every configuration once on a fresh cache
(A B C, then C B A, ...); the best round of each is reported (interference only adds time), and the
median. tok/s counts generated tokens over decode time (the prompt is evaluated before).
"""
import argparse
import json
import statistics
import sys
import urllib.request
import tempfile
import time
from pathlib import Path

import llama_cpp  # noqa: F401  (before numpy, see ggufspec/__init__.py)

ROOT = Path(__file__).resolve().parent.parent

from ggufspec import SpeculativeDecoder  # noqa: E402
from ggufspec.load import LoadParams, open_model  # noqa: E402
from ggufspec.tinymodels import make_lfm2_pair, make_mamba_pair  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_bench import start_llama_server  # noqa: E402


def run_llama_server(url, prompt, n):
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": False}).encode()
    request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        data = json.loads(response.read())
    t = data["timings"]
    return dict(tps=t["predicted_per_second"], tokens=t["predicted_n"], evaluated="", replayed="",
                drafted=t.get("draft_n", 0), accepted=t.get("draft_n_accepted", 0))


def run_one(dec, prompt, n, draft):
    for ctx in (dec.target, dec.draft):
        ctx.keep(0)
    before = dec.target.n_evaluated, dec.target.n_replayed
    kwargs = dict(n_draft=0) if draft == "none" else dict(n_draft=draft)
    t0 = time.perf_counter()
    out = dec.generate(prompt, n_predict=n, temperature=0, **kwargs)
    seconds = out.stats.decode_seconds or (time.perf_counter() - t0)
    return dict(tps=len(out.tokens) / seconds, tokens=len(out.tokens),
                evaluated=dec.target.n_evaluated - before[0], replayed=dec.target.n_replayed - before[1],
                drafted=out.stats.n_drafted, accepted=out.stats.n_accept)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft", default="3", help="comma-separated K values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama-server binary: the same files through llama.cpp")
    ap.add_argument("--arch", choices=["mamba", "lfm2"], default="mamba",
                    help="lfm2: a hybrid where llama.cpp has per-token rollback states; each K runs twice, "
                         "rolled back by snapshots and by n_rs_seq")
    args = ap.parse_args()
    ks = [int(k) for k in args.draft.split(",")] + ["auto"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.arch == "mamba":
            target, draft = make_mamba_pair(Path(tmp), n_layer=args.layers, n_embd=args.n_embd, eos_bias=None)
            title = f"Mamba target {args.layers} layers x {args.n_embd}, draft its first 2 layers"
        else:
            target, draft = make_lfm2_pair(Path(tmp), n_embd=args.n_embd, eos_bias=None)
            title = f"LFM2 target (conv, conv, attention, conv) x {args.n_embd}, draft its first 3 layers"
        prompt = [1, 260, 261, 262, 263, 264, 265, 266]
        n_ctx = args.tokens + 64
        llms = []

        def decoder(n_rs_seq=0):
            params = LoadParams(n_ctx=n_ctx, n_threads=args.threads, n_rs_seq=n_rs_seq)
            llms.extend([open_model(target, "target", params), open_model(draft, "draft", LoadParams(
                n_ctx=n_ctx, n_threads=args.threads))])
            return SpeculativeDecoder(llms[-2], llms[-1])

        decoders = {"snapshot": decoder()}
        if args.arch == "lfm2":
            decoders["n_rs_seq 8"] = decoder(8)
        configs = [("none", name) for name in decoders] + [(k, name) for k in ks for name in decoders]
        for dec in decoders.values():
            run_one(dec, prompt, 16, 3)  # warm up graphs; auto measures its costs on first use
            run_one(dec, prompt, 16, "auto")
        servers = {}
        if args.llama_server:
            spec = [(f"llama-server -md, K={k}", ["-md", str(draft), "--spec-type", "draft-simple",
                                                  "--spec-draft-n-max", str(k)]) for k in ks if k != "auto"]
            for name, extra in [("llama-server alone", [])] + spec:
                servers[name] = start_llama_server(args.llama_server, str(target), args.threads, extra,
                                                   Path(tmp) / f"{len(servers)}.log")
        configs += [("server", name) for name in servers]
        results = {c: [] for c in configs}
        try:
            for r in range(args.rounds):
                for c in (configs if r % 2 == 0 else configs[::-1]):
                    results[c].append(run_llama_server(servers[c[1]][1], prompt, args.tokens) if c[0] == "server"
                                      else run_one(decoders[c[1]], prompt, args.tokens, c[0]))
        finally:
            for proc, _ in servers.values():
                proc.kill()
        costs = {name: dec.costs.get("model") for name, dec in decoders.items()}
        for dec in decoders.values():
            dec.close()
        for llm in llms:
            llm.close()
    base = max(x["tps"] for x in results[("none", "snapshot")])
    server_base = max((x["tps"] for x in results.get(("server", "llama-server alone"), [])), default=None)
    print(f"{title}; {args.tokens} tokens, {args.rounds} rounds, {args.threads} threads")
    print("| config | tok/s (best) | tok/s (median) | vs target alone | target tokens evaluated | "
          "re-evaluated after restore | accepted / drafted |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        runs = results[c]
        best = max(runs, key=lambda x: x["tps"])
        name = {"none": "--no-draft", "auto": "--draft auto", "server": c[1]}.get(c[0], f"--draft {c[0]}")
        if len(decoders) > 1 and c[0] != "server":
            name += f" ({c[1]})"
        alone = server_base if c[0] == "server" else base  # each against its own target alone
        print(f"| {name} | {best['tps']:.0f} | {statistics.median(x['tps'] for x in runs):.0f} | "
              f"{best['tps'] / alone:.2f}x | {best['evaluated']} | {best['replayed']} | "
              f"{best['accepted']} / {best['drafted']} |")
    for name, c in costs.items():
        if c is not None:
            print(f"auto's costs ({name}):", c.summary())


if __name__ == "__main__":
    main()
