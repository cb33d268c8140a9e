"""`splitinfer bench detok`: time per token of streamed detokenization against the reply's length, incremental
(DecodeStream) and the whole-reply decode it replaced, on one reply of up to `--tokens` real tokens.

The reply is a stored `bench spec` run's replies (their token ids) one after another until it is long enough.
Each path streams it through `TextStream` with a listener; the time of every token is recorded and reported per
window of the reply (median and mean microseconds per token). Both paths must give the same text. A measurement
for one machine, not a test: time per token should stay flat with DecodeStream and grow with the reply length
without it. Writes OUT/detok.json and OUT/detok.md.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..errors import ConfigError
from ..tables import table
from .harness import command_line, write


def reply_ids(runs_path: Path, tokens: int) -> list[int]:
    try:
        run = json.loads(runs_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {runs_path} ({exc}); give --runs a `bench spec` speculative.json.") from exc
    replies = sorted({tuple(r["token_ids"]) for r in run["runs"]})
    ids: list[int] = []
    while len(ids) < tokens:
        for reply in replies:
            ids.extend(reply)
    return ids[:tokens]


def stream_times(tokenizer, ids: list[int], incremental: bool) -> tuple[list[float], str]:
    from ..local.text import TextStream

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


def run(args, log=print) -> dict:
    from transformers import AutoTokenizer

    shards = Path(args.shards)
    tokenizer = AutoTokenizer.from_pretrained(shards / "local")
    ids = reply_ids(Path(args.runs), args.tokens)
    new, new_text = stream_times(tokenizer, ids, True)
    old, old_text = stream_times(tokenizer, ids, False)
    report = {"model": json.loads((shards / "local" / "manifest.json").read_text()).get("model_id", str(shards)),
              "runs": args.runs, "tokens": len(ids), "identical": new_text == old_text,
              "incremental": windows(new, args.window), "whole_reply": windows(old, args.window)}
    body = [f"{report['tokens']} tokens of {report['model']}'s stored replies; identical text: {report['identical']}.",
            "", *table(["reply tokens", "DecodeStream median us", "DecodeStream mean us",
                        "whole-reply decode median us", "whole-reply decode mean us"],
                       [[n["tokens"], n["median_us"], n["mean_us"], o["median_us"], o["mean_us"]]
                        for n, o in zip(report["incremental"], report["whole_reply"])])]
    write(Path(args.out), "detok", report, body, title="Streamed detokenization: time per token against reply length",
          command=command_line(args), log=log)
    if not report["identical"]:
        raise ConfigError("the incremental and the whole-reply text differ: DecodeStream is wrong on this reply "
                          f"(see {Path(args.out) / 'detok.json'}).")
    return report
