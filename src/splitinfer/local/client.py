"""The public client API: text in, text out, with the split model underneath.

    from splitinfer.clients import open_client
    client = open_client("shards/smollm2/local", "ws://127.0.0.1:8765", allow_public_weights=True)
    result = client.generate("Explain KV caches.", max_new_tokens=64, on_text=print)

The client owns the tokenizer and chat template; only hidden states leave the process. Each
`generate` call is a one-turn conversation (conversation.py): it opens its own cloud session and closes
it at the end, freeing the server's cache. `client.conversation()` keeps one session across turns.
With a randomised split (`prepare --split-range`) each session (each `make_middle()`) draws its head
depth uniformly from the shard's range with a secret RNG (`ClientConfig.split_seed` only for tests).
`open_client` (clients.py) makes every client: remote, in-process (the middle run here, no server) or
local-only. Given several servers (`open_client(shard, [url, ...])`), each session picks its server by
rendezvous hashing and moves to the next one when its server is gone (failover.py).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding.controller import StepCosts
from ..decoding.sampling import SamplingConfig
from ..decoding.strategies import Strategy, make_strategy
from ..decoding.warm import SuffixMemory, shipped_recycling_table
from ..errors import ConfigError
from ..model.drafthead import DRAFTER_DIR, HEAD_CONFIG, load_shard_head, read_head_info
from ..model.manifest import local_weights_are_public, model_identity
from ..model.shards import LocalHalf, load_local
from ..public_weights import acknowledged
from ..wire.transport import Middle
from .auth import ClientAuth
from .backend import Backend, stop_ids_of
from .config import CLIENT_DEFAULTS, ClientConfig, with_shard_wire_dtype
from .conversation import Conversation
from .failover import FailoverMiddle, ReplicaSet, fetch_replicas, server_list
from .middle import RemoteMiddle
from .session import SplitSession
from .text import chat_prompt_ids, has_chat_template

log = logging.getLogger("splitinfer.local")

PUBLIC_WEIGHTS_WARNING = (
    "warning: the local layers are the stock public weights, so the cloud can run them itself and recover "
    "the prompt and the output from the hidden states it sees (docs/privacy.md). Run `splitinfer privacy privatize` "
    "to make them private."
)


def check_local_weights(manifest: dict, allow_public_weights: bool) -> bool:
    """True when the local weights are stock public ones (and that was allowed, here or once for the shard:
    public_weights.py); raises when not allowed."""
    public = local_weights_are_public(manifest)
    if public and not (allow_public_weights or acknowledged(manifest)):
        raise ConfigError(
            "refusing to connect: the local layers are the stock public weights, which let the cloud recover "
            "your text from what it sees. Make them private with `splitinfer privacy privatize`, or accept that "
            "once for this shard (`splitinfer prepare --allow-public-weights` records it), or per command with "
            "--allow-public-weights (allow_public_weights=True)."
        )
    return public


@dataclass
class Generation:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"
    logprobs: list[float]  # log-probability of each generated token under the model
    stats: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # per-step telemetry records

    def as_dict(self, with_steps: bool = False) -> dict:
        data = {
            "text": self.text,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "logprobs": [round(x, 6) for x in self.logprobs],
            "stats": self.stats,
        }
        if with_steps:
            data["steps"] = self.steps
        return data


def head_depth_drawer(local: LocalHalf, seed: int | None) -> Callable[[], int | None]:
    """A function drawing each session's head depth k uniformly in the shard's [K1, K2]; None for a fixed
    split, so those clients send the v1 hello that older servers accept. The RNG is the OS's (SystemRandom)
    unless a seed is given: a predictable k is only for tests and benchmarks."""
    low, high = local.head_range
    rng = random.SystemRandom() if seed is None else random.Random(seed)
    return lambda: None if low == high else rng.randint(low, high)


def load_draft_head(local: LocalHalf, local_dir: str | Path, mode: str, device: str = "cpu"):
    """The draft head in `local_dir`/drafter (installed by `prepare`), or None: with mode "off", when there
    is none, or when it was trained for another model (a warning says so). A head for this model made for
    another residual basis raises ConfigError (load_shard_head)."""
    directory = Path(local_dir) / DRAFTER_DIR
    if mode == "off" or not (directory / HEAD_CONFIG).is_file():
        return None
    made_for = read_head_info(directory).get("model_fingerprint")
    if made_for != model_identity(local.manifest):
        log.warning("ignoring the draft head in %s: it was trained for another model", directory)
        return None
    return load_shard_head(directory, local, device)


def remote_middles(local: LocalHalf, url: str | Sequence[str], config: ClientConfig,
                   auth: ClientAuth = ClientAuth()) -> Callable[[], Middle]:
    """`make_middle` for a client of cloud servers: each call draws the session's head depth, then builds a
    RemoteMiddle to the one server, or a FailoverMiddle over several (rendezvous hashing, failover.py)."""
    config = with_shard_wire_dtype(config, local.manifest)
    draw = head_depth_drawer(local, config.split_seed)
    urls = server_list(url)
    replicas = ReplicaSet(urls, fetch=lambda server: fetch_replicas(server, auth))  # the sessions' servers

    def remote(server: str, head_layers: int | None) -> RemoteMiddle:
        return RemoteMiddle.for_shard(server, local.manifest, local.config.hidden_size, config.wire_dtype,
                                      auth=auth, head_layers=head_layers)

    def make_middle() -> Middle:
        k = draw()
        if len(urls) == 1:
            return remote(urls[0], k)
        return FailoverMiddle(replicas, lambda server: remote(server, k), head_layers=k)

    return make_middle


class SplitClient:
    """The public front: text or token ids in, a Generation out; `conversation()` for several turns.

    Made by `splitinfer.clients.open_client` (remote, in-process or local-only), the one factory; its
    arguments are the pieces that factory assembles. mode: "split" or "local-only", reported in the stats.
    """

    def __init__(self, local: LocalHalf, make_middle: Callable[[], Middle], config: ClientConfig = ClientConfig(),
                 mode: str = "split", draft_head=None):
        self.local = local
        self.make_middle = make_middle
        self.config = with_shard_wire_dtype(config, local.manifest)
        self.mode = mode
        # What a verified block costs on this deployment, measured by every tree generation and shared by
        # the next ones (the cost of a row is a property of the machines and the link, not of the text).
        self.step_costs = StepCosts()
        # The successor table shipped for this model (decoding/warm.py), or None: every tree starts from it.
        self.recycling_table = shipped_recycling_table(model_identity(local.manifest))
        self.draft_head = draft_head  # a learned draft head (model/drafthead.py), see `load_draft_head`

    @classmethod
    def connect(
        cls,
        local_shard: str | Path,
        url: str | Sequence[str],
        config: ClientConfig = ClientConfig(),
        device: str = "cpu",
        auth: ClientAuth = ClientAuth(),
        allow_public_weights: bool = False,
    ) -> "SplitClient":
        """A client of cloud servers, the Python API's own front door: loads the local half and refuses stock
        public weights unless allowed (entry points go through `clients.open_client`, which also warns)."""
        local = load_local(local_shard, device=device)
        check_local_weights(local.manifest, allow_public_weights)
        return cls.remote(local, local_shard, url, config, device, auth)

    @classmethod
    def remote(cls, local: LocalHalf, local_shard: str | Path, url: str | Sequence[str],
               config: ClientConfig = ClientConfig(), device: str = "cpu",
               auth: ClientAuth = ClientAuth()) -> "SplitClient":
        """A client of cloud servers over `local`, the half of `local_shard` already loaded and through the
        public-weights gate (`check_local_weights` on its manifest): `connect`'s last step, and the remote kind
        of `clients.open_client`, which loads and gates once before calling this."""
        config = with_shard_wire_dtype(config, local.manifest)
        return cls(local, remote_middles(local, url, config, auth), config,
                   draft_head=load_draft_head(local, local_shard, config.drafter, device))

    def backend(self) -> Backend:
        """What a conversation needs from this client, read now (a draft head set later is seen by later ones)."""
        return Backend(
            self.local, lambda: SplitSession(self.local, self.make_middle(), self.config), self._make_strategy,
            stop_ids_of(self.local), self.mode,
        )

    def _make_strategy(self, name: str, memory: SuffixMemory | None) -> Strategy:
        return make_strategy(name, costs=self.step_costs, memory=memory, recycling_table=self.recycling_table,
                             head=self.draft_head)

    # -- prompts and text --------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        tok = self._tokenizer()
        if chat and has_chat_template(tok):
            return chat_prompt_ids(tok, [{"role": "user", "content": prompt}])
        return list(tok(prompt)["input_ids"])

    def _tokenizer(self):
        if self.local.tokenizer is None:
            raise ConfigError("this local shard has no tokenizer; pass token ids instead of text.")
        return self.local.tokenizer

    def stop_ids(self) -> set[int]:
        return set(stop_ids_of(self.local))

    # -- generation --------------------------------------------------------------------------------
    def conversation(self, strategy: str | Strategy = CLIENT_DEFAULTS.strategy, metrics=None,
                     memory=None) -> Conversation:
        """A conversation over this client: one cloud session kept across turns (use it in a `with`);
        `memory`: a SuffixMemory of earlier outputs to draft from (decoding/warm.py)."""
        return Conversation(self.backend(), strategy, metrics, memory)

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = CLIENT_DEFAULTS.max_new_tokens,
        chat: bool = True,
        strategy: str | Strategy = CLIENT_DEFAULTS.strategy,
        on_text: Callable[[str], None] | None = None,
        stop_ids: set[int] | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Generation:
        """Generate from text (chat template applied unless chat=False) or from token ids.

        A generation is a one-turn conversation, closed (its cloud session ended) when it returns. A
        strategy named by string is created fresh for this call, so nothing learned from one generation
        leaks into the next; pass a Strategy instance to keep its state across calls.
        """
        with self.conversation(strategy) as conversation:
            prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, chat)
            turn = conversation.send(prompt_ids, max_new_tokens, sampling, on_text=on_text, stop_ids=stop_ids)
        return Generation(turn.text, prompt_ids, turn.token_ids, turn.finish_reason, turn.logprobs, turn.stats, turn.steps)
