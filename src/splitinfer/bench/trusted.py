"""`splitinfer bench trusted-half`: the trusted half of the paper's configuration on this CPU, `bench step` on a
synthetic 7B-shaped local shard.

Makes the local shard once (`prepare --synthetic CONFIG --sides local`: embedding, 2 + 2 layers, final norm, LM
head; 4.5 GB in float32 for mistral-7b-v0.1, under --shards, which should be gitignored or /tmp), and for int8
and int4 a shard of their own (`--weights FORMAT`, 1.3-1.6 GB, computing in float32), then runs `splitinfer bench
step --sides local` once per weight format and thread count, each in its own process (one thread pinned to core
0; two threads unpinned; float32 and bfloat16 on the float32 shard with `--dtype`), and writes
OUT/<format>-<threads>t/step.{json,md,png} and, over every run under OUT (several invocations may fill one OUT),
OUT/trusted-half.json, OUT/trusted-half.md and OUT/trusted-half.png: ms a step against rows, beside the bytes
bound (the side's weights as stored plus the cached keys/values it reads, over the bandwidth measured in the
same process with the same threads). `--report-only` rebuilds those three from the stored runs.

`--cloud-layers 4` adds the cloud side as a CPU figure: 4 of its 28 layers in bfloat16 (a second synthetic shard,
1.75 GB; the whole cloud half, 12.2 GB in bfloat16, does not fit beside its loading copy in 24 GiB), scaled to
all 28 by per-layer cost; `--formats '' --cloud-layers 4` runs that part alone into the same OUT.

Nothing else should run on the machine meanwhile. Estimated on the project's 2-core CPU from smoke runs of the 7B
shards (making them: 36 s each; a float32 step 0.32 / 0.41 s at 1 / 4 rows, 9.3 GB resident; an int4 step 0.06 /
0.10 s, 2.2 GB), rows 1-64, contexts 64 and 2048, 3 repetitions, 1 and 2 threads: float32 + bfloat16 about 9-10
minutes, int8 + int4 about 4-6 more, `--cloud-layers 4` about 2-3 more. To stay within 10-minute slots, run
`--formats float32,bfloat16`, then `--formats int8,int4 --cloud-layers 4`, into the same OUT.

Its record is not bench/harness.py's pair: OUT/trusted-half.json gathers the `bench step` runs under OUT (each
step.json with its own command and machine) and the commands that filled OUT, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import splitinfer as splitinfer_package

from ..errors import ConfigError
from ..tables import table
from .harness import command_line

FORMATS = ("float32", "bfloat16", "int8", "int4")  # model/formats.py's
FLOAT_FORMATS = ("float32", "bfloat16")  # timed on the float32 shard computing in that dtype (`bench step --dtype`)


def run_splitinfer(argv: list[str], log) -> None:
    """`splitinfer ARGV` in a process of its own, importing this tree."""
    src = str(Path(splitinfer_package.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log("+ splitinfer " + " ".join(argv))
    subprocess.run([sys.executable, "-m", "splitinfer", *argv], check=True, env=env)


def model_layers(config: str) -> int:
    from ..model.synthetic import synthetic_config

    return int(synthetic_config(config)[1]["num_hidden_layers"])


def prepared(config: str, out: Path, side: str, tail_layers: int, dtype: str, log, *extra: str) -> Path:
    """A synthetic shard of `config`'s `side` (2 head layers, `tail_layers` tail layers) at `out`, made once."""
    if not (out / side / "manifest.json").is_file():
        run_splitinfer(["prepare", "--synthetic", config, "--seed", "0", "--sides", side, "--out", str(out),
                        "--head-layers", "2", "--tail-layers", str(tail_layers), "--dtype", dtype, *extra], log)
    return out


def measure(args, shards: str, log) -> None:
    """The shards made where missing, then one `bench step` process per side, format and thread count."""
    steps = []
    for fmt in (f for f in args.formats.split(",") if f):  # '': the cloud layers only
        shard = prepared(args.config, Path(shards), "local", 2, "float32", log)
        if fmt not in FLOAT_FORMATS:  # an integer format is stored so: its own shard, computing in float32
            shard = prepared(args.config, Path(f"{shards}-{fmt}"), "local", 2, "float32", log, "--weights", fmt)
        steps.append(("local", shard, fmt))
    if args.cloud_layers:  # a few of the cloud's layers in bfloat16: the whole cloud half does not fit in memory
        tail = model_layers(args.config) - 2 - args.cloud_layers
        steps.append(("cloud", prepared(args.config, Path(f"{shards}-cloud{args.cloud_layers}"), "cloud", tail,
                                        "bfloat16", log), "bfloat16"))
    for side, directory, fmt in steps:
        for threads in (int(t) for t in args.threads.split(",")):
            name = f"{fmt}-{threads}t" if side == "local" else f"cloud-{fmt}-{threads}t"
            dtype = ["--dtype", fmt] if fmt in FLOAT_FORMATS else []
            run_splitinfer(["bench", "step", "--shards", str(directory), "--sides", side, "--out",
                            str(Path(args.out) / name), "--rows", args.rows, "--contexts", args.contexts, *dtype,
                            "--threads", str(threads), "--cpu", "0" if threads == 1 else "-1", "--repeats",
                            str(args.repeats)], log)


def combine(out: Path, cloud_layers: int | None = None) -> dict:
    """One table over every run under OUT: a row per side, format, threads, context and block rows. Cloud rows
    measured on a few layers are also scaled to `cloud_layers` (per-layer cost times layers; labelled)."""
    runs, rows = [], []
    for path in sorted(out.glob("*/step.json")):
        report = json.loads(path.read_text())
        threads = report["config"]["threads"]
        command = "splitinfer " + report["command"].split("__main__.py ", 1)[1] if "__main__.py " in report["command"] \
            else report["command"]  # run_splitinfer() starts `python -m splitinfer`
        runs.append({"run": path.parent.name, "command": command, "dtype": report["dtype"], "threads": threads,
                     "bandwidth_gbps": report["bandwidth_gbps"], "product_peak_gflops": report["product_peak_gflops"],
                     "synthetic": report.get("synthetic")})
        weights = (report.get("weights") or {}).get("local")
        fmt = weights if weights in ("int8", "int4") else report["dtype"]  # a float shard computes in its format
        for r in report["rows"]:
            scale = cloud_layers / r["layers"] if r["side"] == "cloud" and cloud_layers and r.get("layers") else None
            rows.append({"side": r["side"], "layers": r.get("layers"), "format": fmt, "threads": threads,
                         "context": r["context"], "rows": r["rows"],
                         "scaled_to_side_ms": round(r["splitinfer_ms"] * scale, 1) if scale else None,
                         "splitinfer_ms": r["splitinfer_ms"], "transformers_ms": r["transformers_ms"],
                         "bound_ms": r["bound_ms"], "compute_bound_ms": r["compute_bound_ms"],
                         "bandwidth_gbps": report["bandwidth_gbps"],
                         "over_bound": round(r["splitinfer_ms"] / r["bound_ms"], 2) if r["bound_ms"] else None})
    return {"runs": runs, "rows": rows}


def markdown(result: dict) -> str:
    synthetic = next((r["synthetic"] for r in result["runs"] if r["synthetic"]), None)
    what = (f"synthetic weights in the shape of {synthetic['config']} (seed {synthetic['seed']})" if synthetic
            else "the shards' own weights")
    lines = [f"# The trusted half on this CPU ({what})", "",
             "Local side: embedding lookup, head and tail layers, final norm and the LM head over every row; cloud "
             "side (with --cloud-layers N): N of the cloud's layers in bfloat16 on this CPU, a CPU figure, scaled to all "
             "of the cloud's layers by per-layer cost (the whole cloud half does not fit in this machine's memory). "
             "Medians of ms a step (`bench step`); bound: the side's weights plus the cached keys/values it reads, "
             "over the bandwidth measured in the same process with the same threads. One thread: pinned to core 0; "
             "two threads: unpinned. int8 and int4: their own shard (`--weights`), computing in float32; their "
             "transformers column runs transformers' layers around the same integer products.", "",
             "Made by: " + "; ".join(f"`{c['command']}` ({c['elapsed_s']} s)" for c in result["commands"]), "",
             "Runs:", ""]
    lines += [f"- `{r['run']}`: `{r['command']}` ({r['bandwidth_gbps']} GB/s, product peak {r['product_peak_gflops']} "
              "GFLOP/s)" for r in result["runs"]]
    body = [[r["side"], r["layers"], r["format"], r["threads"], r["context"], r["rows"], r["splitinfer_ms"],
             r["transformers_ms"], r["bound_ms"], f"{r['over_bound']}x" if r["over_bound"] else "-", r["compute_bound_ms"],
             r["scaled_to_side_ms"] if r["scaled_to_side_ms"] is not None else "-"] for r in result["rows"]]
    lines += ["", *table(["side", "layers", "format", "threads", "context", "rows", "splitinfer ms", "transformers ms",
                          "bytes bound ms", "over the bound", "compute bound ms",
                          "cloud: scaled to all its layers ms (a CPU figure)"], body)]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    contexts = sorted({r["context"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 3.8), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        local = [r for r in result["rows"] if r["side"] == "local"]
        for key in sorted({(r["format"], r["threads"]) for r in local}):
            rs = [r for r in local if r["context"] == context and (r["format"], r["threads"]) == key]
            line, = ax.plot([r["rows"] for r in rs], [r["splitinfer_ms"] for r in rs], marker="o",
                            label=f"{key[0]}, {key[1]} thread(s)")
            ax.plot([r["rows"] for r in rs], [r["bound_ms"] for r in rs], linestyle=":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_title(f"trusted half, context {context} (dotted: bytes bound)")
        ax.set_xlabel("block rows")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DOC_MARKERS = ("<!-- trusted-half:start -->", "<!-- trusted-half:end -->")


def update_docs(docs: Path, out: Path, result: dict) -> None:
    """Put the 7B step table (one thread, float32 and bfloat16 beside their bounds) and the plot between the
    markers of `docs`."""
    start, end = DOC_MARKERS
    text = docs.read_text()
    if start not in text or end not in text:
        raise ConfigError(f"{docs} has no {start} ... {end} markers: put them where the table should go.")
    rel = os.path.relpath(out, docs.parent)
    local = [r for r in result["rows"] if r["side"] == "local"]
    body = [[r["format"], r["threads"], r["context"], r["rows"], r["splitinfer_ms"], r["transformers_ms"], r["bound_ms"],
             f"{r['over_bound']}x" if r["over_bound"] else "-"] for r in local]
    made = "; ".join(f"`{c['command']}`" for c in result["commands"])
    block = [f"Stored run: [{rel}/trusted-half.md]({rel}/trusted-half.md) ({made}; every run's command, bandwidth "
             "and the cloud layers, where measured, are there).", "",
             *table(["format", "threads", "context", "rows", "splitinfer ms", "transformers ms", "bytes bound ms",
                     "over the bound"], body), "", f"![the trusted half's step against rows]({rel}/trusted-half.png)"]
    head, rest = text.split(start, 1)
    docs.write_text(head + start + "\n" + "\n".join(block) + "\n" + end + rest.split(end, 1)[1])


def run(args, log=print) -> dict:
    out = Path(args.out)
    shards = args.shards or f"shards/synthetic-{Path(args.config).stem}"
    started = time.monotonic()
    if not args.report_only:
        measure(args, shards, log)
    cloud_layers = model_layers(args.config) - 4  # the cloud's share of the 2 + 2 split
    stored = json.loads((out / "trusted-half.json").read_text()) if (out / "trusted-half.json").is_file() else {}
    commands = stored.get("commands", [])  # the measuring commands, in order (several may fill one OUT)
    if not args.report_only:
        commands.append({"command": command_line(args), "elapsed_s": round(time.monotonic() - started, 1)})
    result = {"commands": commands, **combine(out, cloud_layers)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "trusted-half.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "trusted-half.md").write_text(markdown(result))
    plot(result, out / "trusted-half.png")
    if args.docs:
        update_docs(Path(args.docs), out, result)
    log(f"wrote {out}/trusted-half.json, .md, .png ({round(time.monotonic() - started)} s)")
    return result
