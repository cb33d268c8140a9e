"""The trusted side's typed configuration: `ClientConfig` (one field per `--option` of the client commands),
`ClientOptions` (the commands' defaults beyond it: the strategy name) and the constants they are checked
against. Every default the Python API takes for these comes from here, so a default is written once.

It knows nothing about sessions, links or models; `with_shard_wire_dtype` only reads a manifest dict.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..wire.clientlink import MAX_RETRIES, ROWS_PER_MESSAGE
from ..wire.frame import wire_dtype_of
from ..wire.messages import MAX_HOLD_MS

DRAFTER_MODES = ("auto", "off")
MAX_IN_FLIGHT = 3
AUTO_IN_FLIGHT = 0  # ClientConfig.in_flight (--in-flight auto): the controller chooses, up to MAX_IN_FLIGHT


@dataclass(frozen=True)
class ClientConfig:
    # dtype of hidden states on the wire; None: the one `prepare` recorded in the local shard (float16, or
    # bfloat16 for Gemma 3, whose activations overflow float16); float32 for bit-exact tests
    wire_dtype: str | None = None
    prefill_chunk: int = ROWS_PER_MESSAGE  # rows per prefill message; bounded further by the server's limits
    max_retries: int = MAX_RETRIES  # reconnect attempts per step before giving up
    retry_backoff_s: float = 0.25  # first backoff; doubles on each attempt
    retry_backoff_max_s: float = 8.0  # the doubling stops here, so a long outage is polled, not waited out
    # Split-point randomisation: seeds the per-session draw of the head depth. None (the default) draws
    # from the OS's secret RNG; a seed is for tests and benchmarks only (it makes the depth predictable).
    split_seed: int | None = None
    # The learned draft head in the local shard's drafter/ directory: "auto" uses it when present and made
    # for this model, "off" never loads it.
    drafter: str = "auto"
    # Blocks in flight at once (1-3): with 2 or more, the next block goes out before the previous one's result
    # is back, assuming its most likely outcome; needs a server that speaks protocol v3 (else 1 is used).
    # AUTO_IN_FLIGHT (0): up to MAX_IN_FLIGHT, each block ahead only when its measured costs say it pays.
    in_flight: int = 1
    # Pad every step and its reply to multiples of this many rows (wire/padding.py), so a network observer
    # cannot read block sizes or accepted counts from message sizes (threat T6); 0: off. Output is unchanged.
    pad_rows: int = 0
    # Pad every prompt chunk (and replayed history) and its reply to multiples of this many rows instead, so
    # prompts shorter than it look alike on the wire (their length carried the category best, docs/privacy.md
    # T6); 0: prompts are padded as steps are.
    pad_prompt_rows: int = 0
    # Pad every reply's decode exchanges to a multiple of this many with cover exchanges (wire/cover.py), so
    # an observer cannot count the steps a reply took, which follows how predictable its text was (T6); 0: off.
    # Costs up to this many extra round trips a reply; output is unchanged.
    pad_steps: int = 0
    # Timing padding (T6): the server holds every step's reply until this many ms after the step arrived, so its
    # pass time does not show (a pass that takes longer still does); 0: off.
    pad_hold_ms: int = 0
    # ... and the client sends every step no sooner than this many ms after the previous reply, so its own
    # compute does not show; one block at a time only; 0: off.
    pad_think_ms: int = 0

    def __post_init__(self):
        if self.drafter not in DRAFTER_MODES:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_MODES)}, not {self.drafter!r}")
        if not (1 <= self.in_flight <= MAX_IN_FLIGHT or self.in_flight == AUTO_IN_FLIGHT):
            raise ConfigError(f"--in-flight must be between 1 and {MAX_IN_FLIGHT} blocks, or auto, not {self.in_flight}.")
        if self.pad_rows < 0 or self.pad_prompt_rows < 0:
            raise ConfigError(f"--pad-rows and --pad-prompt-rows must be 0 (off) or positive row counts, not "
                              f"{self.pad_rows} and {self.pad_prompt_rows}.")
        if min(self.pad_steps, self.pad_hold_ms, self.pad_think_ms) < 0 or self.pad_hold_ms > MAX_HOLD_MS:
            raise ConfigError(f"--pad-steps, --pad-hold-ms and --pad-think-ms must be 0 (off) or positive (a hold at "
                              f"most {MAX_HOLD_MS} ms), not {self.pad_steps}, {self.pad_hold_ms} and {self.pad_think_ms}.")
        if self.pad_think_ms and self.in_flight != 1:
            raise ConfigError("--pad-think-ms paces one block at a time; use it with --in-flight 1.")

    def backoff_s(self, attempt: int) -> float:
        """Delay before reconnect `attempt` (0-based): exponential, capped, with jitter in [1/2, 1] of it so
        that clients cut off together (a server restart) do not all come back in the same instant."""
        return min(self.retry_backoff_s * (2**attempt), self.retry_backoff_max_s) * random.uniform(0.5, 1.0)


def with_shard_wire_dtype(config: ClientConfig, manifest: dict) -> ClientConfig:
    """`config` with the wire dtype the local shard records, where the caller left it unset."""
    return config if config.wire_dtype is not None else replace(config, wire_dtype=wire_dtype_of(manifest))

@dataclass(frozen=True)
class ClientOptions:
    """The client commands' and the Python API's defaults beyond ClientConfig's."""

    strategy: str = "tree"  # decoding strategy (decoding/strategies.py STRATEGIES); all give the same greedy output
    max_new_tokens: int = 128  # tokens a generation may add (SplitClient.generate, `splitinfer generate`)


CLIENT_DEFAULTS = ClientOptions()
