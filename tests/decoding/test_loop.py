"""The decoding loop against a model-free verifier: one block at a time it needs only run_block/commit (through
`OneAtATime`) and a strategy's blocks; with blocks in flight, a verifier that answers blocks in order."""

from __future__ import annotations

import subprocess
import sys

import torch

from splitinfer.decoding.draft import Draft, SideRows
from splitinfer.decoding.loop import decode
from splitinfer.decoding.strategies import Jacobi, Lookahead, LookaheadConfig, Sequential, Strategy
from splitinfer.decoding.verifier import OneAtATime
from splitinfer.masks import BlockStructure

VOCAB = 50
PROMPT = [3, 9, 4, 3, 9]


def successor(token: int) -> int:
    return (7 * token + 3) % VOCAB


def truth(start: int, n: int) -> list[int]:
    out, token = [], start
    for _ in range(n):
        token = successor(token)
        out.append(token)
    return out


class MarkovVerifier:
    """A 'model' whose next token depends on the current token only; logits row r predicts successor(tokens[r])."""

    def __init__(self):
        self.blocks: list[tuple[list[int], BlockStructure, list[int] | None]] = []
        self.commits: list[list[int]] = []

    def run_block(self, tokens, structure, kind="decode", logits_from=0, depths=None):
        self.blocks.append((list(tokens), structure, depths))
        logits = torch.full((len(tokens), VOCAB), -5.0)
        logits[torch.arange(len(tokens)), [successor(t) for t in tokens]] = 5.0
        return logits[logits_from:]

    def commit(self, rows):
        self.commits.append(list(rows))


class HalfRight(Strategy):
    """Drafts the true next two tokens under a wrong sibling, so accepted rows are not a block prefix."""

    name = "half-right"

    def propose(self, history):
        nxt = truth(history[-1], 2)
        wrong = (nxt[0] + 1) % VOCAB
        return Draft(tokens=[wrong, nxt[0], nxt[1]], parents=[0, 0, 2], scores=[0.5] * 3)


def run(strategy: Strategy, n: int = 12, emit_stop=lambda token: False):
    verifier = MarkovVerifier()
    emitted: list[int] = []

    def emit(token, _logprob):
        emitted.append(token)
        return emit_stop(token)

    logits = MarkovVerifier().run_block(PROMPT[-1:], BlockStructure.chain())
    finish = decode(OneAtATime(verifier), PROMPT, logits, n, set(), emit, strategy)
    return finish, emitted, verifier


def test_every_strategy_emits_the_verifiers_greedy_sequence():
    expected = truth(PROMPT[-1], 12)
    for strategy in (Sequential(), Jacobi(), Lookahead(), Lookahead(LookaheadConfig(window=3)), HalfRight()):
        finish, emitted, _ = run(strategy)
        assert (finish, emitted) == ("length", expected), strategy.name


def test_commits_name_the_accepted_path_and_count_what_was_accepted():
    _, emitted, verifier = run(HalfRight())
    # Every step keeps the root, the right child (row 2) and its child (row 3), never the wrong sibling.
    assert verifier.commits == [[0, 2, 3]] * 4
    assert len(emitted) == 12


def test_side_rows_are_verified_with_their_depths_but_never_committed():
    _, _, verifier = run(Lookahead(LookaheadConfig(window=3)))
    tokens, structure, depths = verifier.blocks[0]
    levels, width = LookaheadConfig().ngram - 1, 3
    assert len(tokens) == len(depths) == 1 + levels * width  # no pool hits yet: the root and the window
    assert structure.kind == "matrix"
    assert depths[:4] == [0, 1, 2, 3]
    for (block, _, _), rows in zip(verifier.blocks, verifier.commits):
        assert max(rows) < len(block) - levels * width


def test_emit_can_end_decoding():
    stop_at = truth(PROMPT[-1], 4)[-1]
    finish, emitted, _ = run(Sequential(), emit_stop=lambda token: token == stop_at)
    assert (finish, emitted) == ("stop", truth(PROMPT[-1], 4))


def test_draft_lays_out_its_own_block():
    assert Draft().to_block(7).structure.kind == "chain"
    tree = Draft(tokens=[4, 5, 6], parents=[0, 1, 0]).to_block(99)
    assert (tree.tokens, tree.parents, tree.depths, tree.structure.kind) == ([99, 4, 5, 6], [-1, 0, 1, 0], None, "tree")
    side = SideRows(tokens=[7, 8], depths=[1, 2], sees=[[0], [0, 1]])
    block = Draft(tokens=[4], parents=[0], side=side).to_block(99)
    assert block.tokens == [99, 4, 7, 8] and block.tree_tokens == [99, 4]
    assert block.depths == [0, 1, 1, 2]
    allowed = block.structure.allowed(4)
    assert allowed[2].tolist() == [True, False, True, False]  # a side row sees the root and itself, not the tree


def test_decoding_imports_nothing_from_the_client_or_the_cloud():
    code = (
        "import sys, splitinfer.decoding.loop, splitinfer.decoding.strategies; "
        "print(sorted(m for m in sys.modules if m.startswith(('splitinfer.local', 'splitinfer.cloud', 'splitinfer.api'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
