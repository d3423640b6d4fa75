#!/bin/bash
# quantized KV cache vs f16 on the demo pair: target alone and --draft auto, same run
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/kv-cache-types.jsonl}  # round 22: kv-cache-types-intel-r22.jsonl
: > $OUT
for round in 0 1; do
for p in "def quicksort(arr):" "Write a Python function that parses an ISO 8601 date string and returns a datetime." "class LRUCache:\n    def __init__(self, capacity):"; do
  for kv in f16 q8_0 q4_0; do
    for mode in "--no-draft" "--draft auto"; do
      line=$(.venv/bin/ggufspec run -p "$p" -e -n 128 --temp 0 -t 2 -ctk $kv -ctv $kv $mode --json 2>/dev/null)
      python3 -c "import json,sys; d=json.loads(sys.argv[1]); s=d['stats']; print(json.dumps({'round': $round, 'prompt': sys.argv[2][:20], 'kv': '$kv', 'mode': '$mode', 'tps': s['decode_tps'], 'n': s['n_predict'], 'accept': s.get('accept'), 'text': d['text']}))" "$line" "$p" >> $OUT
    done
  done
done
done
