"""Perplexity of the held-out prompts per --weights spec on one source (which part costs Gemma's int8 its perplexity)."""
import json, sys, time
from importlib import resources
from pathlib import Path
import numpy as np, torch
from splitinfer import kernels
from splitinfer.bench.formats import _Whole
from splitinfer.model.formats import WeightFormats
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud, load_local
from splitinfer.model.source import load_source

kernels.ensure()
torch.set_num_threads(1)
source = load_source(sys.argv[1])
specs = sys.argv[2].split(";")
heldout = [json.loads(l)["prompt"] for l in resources.files("splitinfer.data").joinpath("heldout.jsonl").read_text().splitlines() if l.strip()]
ids = [source.tokenizer(t)["input_ids"] for t in heldout]
out = {}
for spec in specs:
    t = time.time()
    d = Path("/tmp/weights-auto-probe") / spec.replace(",", "+").replace("=", "-")
    prepare(source, d, weights=WeightFormats.parse(spec))
    m = _Whole(load_local(d / "local"), load_cloud(d / "cloud"))
    nll = sum(m.nll(x) for x in ids); n = sum(len(x) - 1 for x in ids)
    out[spec] = float(np.exp(nll / n))
    print(spec, round(out[spec], 4), f"{out[spec] / out[specs[0]] - 1:+.2%}", f"{time.time() - t:.0f}s", flush=True)
