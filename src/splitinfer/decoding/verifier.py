"""What a decoding strategy needs from the model: verify a block in one pass, then commit a path.

`Verifier` is the seam between decoding/ and whatever runs the model (the split session of local/, a
whole model in one process, a test double). Decoding imports this Protocol and never the session, so the
import direction stays decoding -> nothing above it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..masks import BlockStructure


class Verifier(Protocol):
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

    def features(self) -> torch.Tensor:
        """[q, d] final hidden states, before the final norm, of every row of the last `run_block` (of
        every chunk of the last prefill): what a draft head on the trusted side reads. Strategies that
        set `uses_features` get them from the loop; others never ask."""
        ...
