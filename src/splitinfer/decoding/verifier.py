"""What the decoding loop needs from the model: send a block, get its logits back, keep the accepted rows.

`Verifier` is the seam between decoding/ and whatever runs the model (the split session of local/, a test
double). It carries blocks in flight: a block may go out before the ones before it are resolved, assuming
which of their rows they keep; `in_flight` says how many may be out at once (1: one block at a time).
`BlockRunner` is the smaller seam of a model that runs one block at a time (`run_block`, then `commit`);
`OneAtATime` makes a Verifier of it. Decoding imports these Protocols and never the session, so the import
direction stays decoding -> nothing above it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..masks import BlockStructure


class BlockRunner(Protocol):
    def run_block(
        self,
        tokens: list[int],
        structure: BlockStructure,
        kind: str = "decode",
        logits_from: int = 0,
        depths: list[int] | None = None,
    ) -> torch.Tensor:
        """tokens: q ids -> logits [q - logits_from, vocab] float32 for rows logits_from..q-1.

        The block stays pending until `commit`. kind names the step in telemetry ("prefill" or "decode");
        depths: each row's distance from the committed sequence when rows are not consecutive (default
        `structure.depths(q)`, or 0..q-1).
        """
        ...

    def commit(self, rows: list[int]) -> None:
        """Accept `rows` of the pending block (a contiguous path from its first row); drop the rest."""
        ...

    def features(self, states: tuple[int, ...] = ()) -> torch.Tensor:
        """[q, d (1 + len(states))] final hidden states, before the final norm, of every row of the last block
        (of every chunk of the last prefill): what a draft head on the trusted side reads; then the hidden
        states `states` (HF numbering) of the same rows, where the runner has them (ConfigError where not).
        Strategies that set `uses_features` get them from the loop; others never ask."""
        ...


class Verifier(Protocol):
    in_flight: int  # blocks that may be in flight at once (1: one block at a time)
    pinned: bool  # True: keep in_flight blocks out whenever a guess allows; False: the controller decides

    def send_block(
        self, tokens: list[int], structure: BlockStructure, depths: list[int] | None, assume: list[list[int]],
        wait: bool = False,
    ) -> bool:
        """Send a block assuming each unresolved block before it keeps the given rows (none when it is the only
        one); False when the link was lost (every block in flight is gone, this one was not sent). wait: no
        block goes out before this one is resolved (one block at a time), so it may run to the end at once."""
        ...

    def receive_block(self) -> torch.Tensor | None:
        """Logits [q, vocab] of the oldest unresolved block; None when the link was lost with it."""
        ...

    def block_costs(self) -> tuple[float, float]:
        """(cloud compute ms, local tail ms) of the block `receive_block` returned last."""
        ...

    def resolve(self, rows: list[int], assumption: tuple[float, bool] | None = None) -> None:
        """Accept `rows` (a path from one of its roots) of the oldest received block. assumption: the chance
        given to what a block after it assumed (or would have), and whether that held; for telemetry."""
        ...

    def drop_unresolved(self) -> None:
        """Forget every unresolved block."""
        ...

    def settle(self) -> None:
        """Forget what is still in flight once decoding ends."""
        ...

    def features(self, states: tuple[int, ...] = ()) -> torch.Tensor:
        """Final features (and `states`) of the block `receive_block` returned last (BlockRunner.features)."""
        ...


class OneAtATime:
    """A Verifier over a BlockRunner: each block runs when sent, and is committed when resolved."""

    in_flight = 1
    pinned = True

    def __init__(self, runner: BlockRunner):
        self.runner = runner
        self._logits: torch.Tensor | None = None

    def send_block(self, tokens, structure, depths, assume, wait=False) -> bool:
        assert not assume and self._logits is None, "one block at a time"
        self._logits = self.runner.run_block(tokens, structure, depths=depths)
        return True

    def receive_block(self) -> torch.Tensor | None:
        logits, self._logits = self._logits, None
        return logits

    def block_costs(self) -> tuple[float, float]:
        return 0.0, 0.0  # read only to send blocks ahead, which never happens here

    def resolve(self, rows, assumption=None) -> None:
        self.runner.commit(rows)

    def drop_unresolved(self) -> None:
        self._logits = None

    def settle(self) -> None:
        self._logits = None

    def features(self, states: tuple[int, ...] = ()) -> torch.Tensor:
        return self.runner.features(states)
