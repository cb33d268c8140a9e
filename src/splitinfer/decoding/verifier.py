"""What the decoding loop needs from whatever runs the model: verify a block, then commit its accepted rows.

The loop sees only this Protocol; the split session (local/ + the link to the cloud) is one implementation,
and a test can supply another. Decoding therefore imports nothing from local/, cloud/ or api/.
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
        """tokens: q ids of the block -> logits [q - logits_from, vocab] for rows logits_from..q-1.

        The block stays pending until `commit`. depths: each row's distance from the committed sequence,
        for blocks whose rows are not consecutive (default: the structure's own depths).
        """
        ...

    def commit(self, rows: list[int]) -> None:
        """Accept `rows` of the pending block (a contiguous path from its first row) and drop the rest."""
        ...
