"""The plain-transformers split: the anchor that `bench plain-split` runs splitinfer's split against.

The same shards, the same split and the same wire, with none of splitinfer's model code in the compute:
each side is a transformers causal LM built from the config with only its own layers (renumbered 0..n-1,
attention "sdpa", products `F.linear`), its own `DynamicCache`, and transformers' own forward (positions,
causal mask, rotary). Hidden states cross the project's wire codec (wire/messages.py: Hello, Step, Result)
over a WebSocket, so a decode step costs the same round trips and the same bytes as splitinfer's
sequential decoding. This module holds the halves' builders, the local half's client (`PlainSplitClient`:
embedding and head layers, the step over the wire, tail layers, norm and LM head, greedy) and the cloud
half's server, run as its own process (`python -m splitinfer.bench.plaincloud --shard DIR --port P
--threads 1`): one session per connection, answered in the connection's thread, no scheduler, no session
table, no compute thread.

What it deliberately does not do: trees, blocks in flight, resumption, tokens, TLS. It runs chains only
(sequential decoding), which is all an anchor for split sequential needs; anything else is refused with a
protocol error that says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ProtocolError, SplitInferError
from ..masks import BlockStructure
from ..wire.frame import WIRE_DTYPES
from ..wire.messages import (
    Close, Error, Hello, Limits, Probe, ProbeReply, Result, Step, Welcome, decode_client_message,
)
from .baseline import plain_model, with_ends

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_BLOCK_ROWS = 1024
WEIGHTS = "weights.safetensors"


def cache_kwarg(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` in its forward signatures; either works here."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def read_shard(directory: Path) -> tuple[object, dict, dict]:
    """(transformers config, weights, manifest) of one prepared shard, read with transformers and safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    manifest = json.loads((directory / "manifest.json").read_text())
    return AutoConfig.from_pretrained(str(directory)), load_file(str(directory / WEIGHTS)), manifest


def plain_part(config, weights: dict, layers: range, embed: bool, tail: bool, dtype: torch.dtype) -> nn.Module:
    """A transformers causal LM holding layers `layers` of the model (renumbered from 0), with the token
    embedding when `embed` and the final norm and LM head when `tail`; what a side does not hold is an
    identity. Built by bench/baseline.py's one builder, then loaded with exactly the weights it needs."""
    model = plain_model(config, list(layers), dtype, vocabulary=embed or tail)
    state = {}
    for key, value in weights.items():
        parts = key.split(".")
        if key.startswith("model.layers.") and int(parts[2]) in layers:
            state[".".join(["model", "layers", str(int(parts[2]) - layers.start), *parts[3:]])] = value
        elif (key == "model.embed_tokens.weight" and (embed or tail)) or (tail and key in ("model.norm.weight",
                                                                                              "lm_head.weight")):
            state[key] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    wanted = [k for k in missing if k.startswith("model.layers.") or (tail and k == "model.norm.weight")]
    if unexpected or wanted:
        raise ValueError(f"the shard does not hold the plain model's weights (missing {wanted[:3]}, unexpected "
                         f"{unexpected[:3]}); the plain split reads unprivatized shards made by `splitinfer prepare`.")
    if tail and "lm_head.weight" not in state:
        model.lm_head.weight = model.model.embed_tokens.weight  # tied (SmolLM2, Gemma)
    body = model.model
    with_ends(model, body.embed_tokens if embed else None, body.norm if tail else None, model.lm_head if tail else None)
    return model.to(dtype).eval().requires_grad_(False)


def load_cloud_part(shard: Path, dtype: str | None = None) -> tuple[nn.Module, dict]:
    """The cloud shard's middle layers as a plain transformers model, and the shard's manifest."""
    config, weights, manifest = read_shard(Path(shard))
    start, end = manifest["split"]["cloud_layers"]
    torch_dtype = WIRE_DTYPES[dtype or manifest["dtype"]]
    return plain_part(config, weights, range(start, end), False, False, torch_dtype), manifest


@dataclass
class PlainSession:
    """One connection's session: the middle's cache and the rows of the block it ran last (lazy commit)."""

    cache: object
    wire_dtype: str
    pending: int = 0


class PlainCloud:
    """Answers one connection's messages with the plain middle (sans-I/O: bytes in, bytes out)."""

    def __init__(self, model: nn.Module, manifest: dict):
        self.model = model
        self.manifest = manifest
        self.layers = tuple(manifest["split"]["cloud_layers"])
        self.dtype = next(model.parameters()).dtype
        self.limits = Limits(hidden_size=model.config.hidden_size, max_block_rows=MAX_BLOCK_ROWS)
        self.kwarg = cache_kwarg(model)
        self.sessions = 0

    def answer(self, data: bytes, session: PlainSession | None) -> tuple[bytes | None, PlainSession | None]:
        """(reply, the connection's session after it); reply None when the client closed the session."""
        start = time.perf_counter()
        try:
            message = decode_client_message(data, self.limits)
            if isinstance(message, Close):
                return None, None
            if isinstance(message, Probe):
                return ProbeReply(message.seq, len(message.payload), bytes(message.reply_bytes)).encode(), session
            if isinstance(message, Hello):
                return self.hello(message)
            if session is None:
                raise ProtocolError("send hello before the first step.")
            return self.step(message, session, start).encode(), session
        except SplitInferError as exc:
            return Error.from_exception(exc).encode(), session

    def hello(self, hello: Hello) -> tuple[bytes, PlainSession]:
        from transformers import DynamicCache

        if tuple(hello.cloud_layers) != self.layers or hello.fingerprint != self.manifest["cloud_fingerprint"]:
            raise ProtocolError(f"this plain server holds layers {list(self.layers)} of another shard; point the "
                                "client at the shard the server was started with.")
        self.sessions += 1
        session = PlainSession(DynamicCache(config=self.model.config), hello.wire_dtype)
        welcome = Welcome(f"plain-{self.sessions}", 0, False, MAX_MESSAGE_BYTES, MAX_BLOCK_ROWS)
        return welcome.encode(), session

    @torch.inference_mode()
    def step(self, step: Step, session: PlainSession, start: float) -> Result:
        """Commit the kept rows of the last block (a prefix: chains only), run this block, return its rows."""
        q = step.hidden.shape[0]
        if step.structure.kind != "chain" or step.assume or step.keep != tuple(range(len(step.keep))):
            raise ProtocolError("the plain transformers server runs chains only (sequential decoding): no trees, "
                                "no blocks in flight, and a keep list that is a prefix of the last block.")
        cache = session.cache
        dropped = session.pending - len(step.keep)
        if dropped < 0:
            raise ProtocolError(f"the keep list names {len(step.keep)} rows of a {session.pending}-row block.")
        if dropped:
            cache.crop(-dropped)  # negative: drop that many rows from the end (every transformers 5 release)
        committed = cache.get_seq_length()
        if step.positions != tuple(range(committed, committed + q)):
            raise ProtocolError(f"positions must continue the cache ({committed} rows): send {committed} onward.")
        t0 = time.perf_counter()
        hidden = step.hidden.to(self.dtype)[None]  # [1, q, d]
        out = self.model.model(inputs_embeds=hidden, use_cache=True, **{self.kwarg: cache}).last_hidden_state[0]
        compute_ms = (time.perf_counter() - t0) * 1e3
        session.pending = q
        return Result(step.seq, out, compute_ms, (time.perf_counter() - start) * 1e3, committed, session.wire_dtype)


class PlainSplitClient:
    """The local half in plain transformers (embedding and head layers; tail layers, norm and LM head), and
    a WebSocket to a middle (wire/messages.py's protocol): sequential greedy decoding, timed per step."""

    def __init__(self, shard: Path, url: str, wire_dtype: str, dtype: str | None = None):
        from ..local.middle import RemoteMiddle

        config, weights, manifest = read_shard(Path(shard))
        split, torch_dtype = manifest["split"], WIRE_DTYPES[dtype or manifest["dtype"]]
        n, k, m = split["num_layers"], split["head_layers"], split["tail_layers"]
        self.head = plain_part(config, weights, range(0, k), True, False, torch_dtype)
        self.tail = plain_part(config, weights, range(n - m, n), False, True, torch_dtype)
        self.dtype, self.wire_dtype = torch_dtype, wire_dtype
        self.middle = RemoteMiddle.for_shard(url, manifest, config.hidden_size, wire_dtype)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> dict:
        """{"token_ids", "stats", "steps"}: the stop token, when one ends it, is the last of token_ids."""
        from transformers import DynamicCache

        kwarg = cache_kwarg(self.head)
        caches = ({kwarg: DynamicCache(config=self.head.config)}, {kwarg: DynamicCache(config=self.tail.config)})
        self.middle.open()
        self.seq, self.keep = 0, ()
        try:
            logits, _ = self._block(torch.tensor([prompt_ids]), 0, caches)
            tokens, steps = [int(logits[0, -1].argmax())], []
            first = time.perf_counter()
            while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
                logits, record = self._block(torch.tensor([[tokens[-1]]]), len(prompt_ids) + len(tokens) - 1, caches)
                tokens.append(int(logits[0, -1].argmax()))
                steps.append(record)
            decode_s = time.perf_counter() - first
        finally:
            self.middle.close()
        rate = round((len(tokens) - 1) / decode_s, 3) if len(tokens) > 1 and decode_s > 0 else 0.0
        return {"token_ids": tokens, "steps": steps, "stats": {"tokens_per_s": rate, "decode_s": round(decode_s, 4),
                                                               "generated_tokens": len(tokens), "prefill_messages": 1}}

    def _block(self, ids: torch.Tensor, start: int, caches: tuple[dict, dict]) -> tuple[torch.Tensor, dict]:
        """Head, the middle over the wire, tail: (logits of the last row [1, 1, vocab], the step's times)."""
        t0 = time.perf_counter()
        q = ids.shape[1]
        hidden = self.head.model(input_ids=ids, use_cache=True, **caches[0]).last_hidden_state  # [1, q, d]
        t1 = time.perf_counter()
        positions = tuple(range(start, start + q))
        step = Step(self.seq, self.keep, positions, BlockStructure.chain(), hidden[0], self.wire_dtype)
        result, io = self.middle.step(step)
        self.seq, self.keep = self.seq + 1, tuple(range(q))
        t2 = time.perf_counter()
        logits = self.tail(inputs_embeds=result.hidden.to(self.dtype)[None], use_cache=True, logits_to_keep=1,
                           **caches[1]).logits
        local_ms = (t1 - t0 + time.perf_counter() - t2) * 1e3
        return logits, {"kind": "decode", "round_trip_ms": io.round_trip_ms, "serialize_ms": io.serialize_ms,
                        "local_ms": local_ms, "cloud_compute_ms": result.compute_ms, "bytes_up": io.bytes_up,
                        "bytes_down": io.bytes_down, "accepted": 1}


def serve(cloud: PlainCloud, port: int, host: str = "127.0.0.1"):
    """A websockets server (not yet serving) whose connections each run one session through `cloud`."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.server import serve as ws_serve

    def handler(ws) -> None:
        session = None
        try:
            for data in ws:
                reply, session = cloud.answer(data, session)
                if reply is None:
                    return
                ws.send(reply)
        except ConnectionClosed:
            return

    return ws_serve(handler, host, port, compression=None, max_size=MAX_MESSAGE_BYTES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitinfer.bench.plaincloud",
                                     description="the cloud half of the plain transformers split (bench plain-split)")
    parser.add_argument("--shard", required=True, help="a prepared cloud shard (OUT/cloud)")
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--threads", required=True, type=int, help="torch threads")
    parser.add_argument("--dtype", choices=tuple(WIRE_DTYPES), help="compute dtype (omitted: the shard's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model, manifest = load_cloud_part(Path(args.shard), args.dtype)
    with serve(PlainCloud(model, manifest), args.port) as server:
        server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
