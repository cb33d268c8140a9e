"""Time per token of streamed detokenization against the reply's length, incremental (DecodeStream) and the
whole-reply decode it replaced, on one reply of up to 4,096 real tokens.

    .venv/bin/python scripts/bench_detok.py --shards shards/smollm2 --runs notes/bench/readme/speculative.json \
        --out notes/bench/detok

The reply is the stored benchmark replies (their token ids) one after another until it is --tokens long.
Each path streams it through `TextStream` with a listener; the time of every token is recorded and reported
per window of the reply (median and mean microseconds per token). Both paths must give the same text.
A measurement for one machine, not a test: time per token should stay flat with DecodeStream and grow
with the reply length without it. Writes detok.json and detok.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from splitinfer.local.text import TextStream


def reply_ids(runs_path: Path, tokens: int) -> list[int]:
    run = json.loads(runs_path.read_text())
    replies = sorted({tuple(r["token_ids"]) for r in run["runs"]})
    ids: list[int] = []
    while len(ids) < tokens:
        for reply in replies:
            ids.extend(reply)
    return ids[:tokens]


def stream_times(tokenizer, ids: list[int], incremental: bool) -> tuple[list[float], str]:
    pieces: list[str] = []
    stream = TextStream(tokenizer, pieces.append)
    if not incremental:
        stream.incremental = None  # the whole reply decoded again for every token
    times = []
    for token in ids:
        start = time.perf_counter()
        stream.push(token)
        times.append(time.perf_counter() - start)
    stream.finish()
    return times, "".join(pieces)


def windows(times: list[float], width: int) -> list[dict]:
    out = []
    for start in range(0, len(times), width):
        chunk = [t * 1e6 for t in times[start:start + width]]
        out.append({"tokens": f"{start + 1}-{start + len(chunk)}", "median_us": round(statistics.median(chunk), 1),
                    "mean_us": round(statistics.fmean(chunk), 1)})
    return out


def markdown(report: dict) -> str:
    lines = ["# Streamed detokenization: time per token against reply length", "",
             f"Command: `{report['command']}`; {report['machine']}; {report['tokens']} tokens "
             f"({report['model']}); identical text: {report['identical']}.", "",
             "| reply tokens | DecodeStream median us | DecodeStream mean us | whole-reply decode median us "
             "| whole-reply decode mean us |", "|---|---:|---:|---:|---:|"]
    for new, old in zip(report["incremental"], report["whole_reply"]):
        lines.append(f"| {new['tokens']} | {new['median_us']} | {new['mean_us']} | {old['median_us']} "
                     f"| {old['mean_us']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="shards/smollm2")
    p.add_argument("--runs", default="notes/bench/readme/speculative.json", help="a stored bench spec run")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default="notes/bench/detok")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(Path(args.shards) / "local")
    ids = reply_ids(Path(args.runs), args.tokens)
    new, new_text = stream_times(tokenizer, ids, True)
    old, old_text = stream_times(tokenizer, ids, False)
    report = {
        "command": "python scripts/bench_detok.py " + shlex.join(sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.python_version()}".strip(),
        "model": json.loads((Path(args.shards) / "local" / "manifest.json").read_text()).get("model_id", args.shards),
        "tokens": len(ids), "identical": new_text == old_text,
        "incremental": windows(new, args.window), "whole_reply": windows(old, args.window),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "detok.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "detok.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
