"""Blocks with several candidate roots (decoding/roots.py): the candidates and their drafts taken from a
predicted tree, the block's layout and what each row sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitinfer.decoding.draft import Draft
from splitinfer.decoding.roots import candidate_roots, likeliest_outcome, multi_root_block, top_path
from splitinfer.wire.inflight import Prefix, prefix_mask

# A predicted tree below the assumed text: first level 10 (0.5), 20 (0.3), 30 (0.01); 11 and 12 below 10,
# 21 below 20 and 22 below 21.
PREDICTED = Draft(
    tokens=[10, 20, 30, 11, 12, 21, 22],
    parents=[0, 0, 0, 1, 1, 2, 6],
    scores=[0.5, 0.3, 0.01, 0.4, 0.05, 0.15, 0.06],
    sources=["s"] * 7,
    keys=list(range(7)),
    proposers=[("s",)] * 7,
)


def test_the_candidates_are_the_likeliest_first_level_tokens_with_their_predicted_drafts():
    roots, scores, drafts = candidate_roots(PREDICTED, max_roots=4, floor=0.02, nodes=1)
    assert (roots, scores) == ([10, 20], [0.5, 0.3])  # 30 is below the floor
    assert (drafts[0].tokens, drafts[0].parents, drafts[0].scores) == ([11], [0], [pytest.approx(0.8)])
    assert (drafts[1].tokens, drafts[1].parents, drafts[1].scores) == ([21], [0], [pytest.approx(0.5)])
    assert drafts[1].keys == [5]  # what the source learns from when the node is verified
    _, _, deeper = candidate_roots(PREDICTED, max_roots=4, floor=0.02, nodes=2)
    assert (deeper[1].tokens, deeper[1].parents) == ([21, 22], [0, 1])
    assert candidate_roots(PREDICTED, max_roots=1, floor=0.0, nodes=0) == ([10], [0.5], [Draft()])
    assert candidate_roots(Draft(), 4, 0.02, 2) == ([], [], [])


def test_several_roots_sit_side_by_side_and_each_draft_hangs_below_its_own():
    drafts = [Draft([11, 12], [0, 1], [0.5, 0.4]), Draft(), Draft([31], [0], [0.2])]
    block, rows = multi_root_block([10, 20, 30], drafts)
    assert block.tokens == [10, 20, 30, 11, 12, 31] and block.parents == [-1, -1, -1, 0, 3, 2]
    assert rows == [[0, 3, 4], [1], [2, 5]]
    assert block.structure.depths(6) == [0, 0, 0, 1, 2, 1]
    allowed = block.structure.allowed(6)
    assert allowed[:3, :3].tolist() == np.eye(3, dtype=bool).tolist()  # a root sees no other root
    assert allowed[4].tolist() == [True, False, False, True, True, False]
    assert allowed[5].tolist() == [False, False, True, False, False, True]
    one, own = multi_root_block([10], drafts[:1])
    assert (one.tokens, one.parents, own) == ([10, 11, 12], [-1, 0, 1], [[0, 1, 2]])


def test_every_root_sees_the_assumed_rows_at_one_position():
    block, _ = multi_root_block([10, 20], [Draft([11], [0], [0.5]), Draft()])
    prefix = Prefix.of([((4, 5, 5), (0, 2))])  # the block before: rows 0 and 2 assumed kept
    positions = torch.tensor([6, 6, 7])
    mask = prefix_mask(4, prefix, positions, block.structure.allowed(3), torch.float32)  # [1, 1, 3, 4 + 3 + 3]
    seen = (mask[0, 0] == 0).numpy()
    assert seen[:, :4].all() and seen[:, [4, 6]].all() and not seen[:, 5].any()
    assert seen[:, 7:].tolist() == [[True, False, False], [False, True, False], [True, False, True]]


def test_the_top_path_follows_the_best_child():
    assert top_path(Draft([11, 12, 13], [0, 0, 1], [0.2, 0.6, 0.1])) == [0, 2]
    assert top_path(Draft([11, 12, 13], [0, 0, 1], [0.6, 0.2, 0.1])) == [0, 1, 3]
    assert top_path(Draft()) == [0]


def test_children_tokens_are_no_candidates_after_their_parent():
    roots, _, _ = candidate_roots(PREDICTED, max_roots=4, floor=0.02, nodes=0, exclude={10})
    assert roots == [20]


def asked(answers: dict[int, tuple[list[int], list[float]]], log: list):
    """A strategy's candidates after each path length, the excluded tokens taken out as candidate_roots does."""

    def candidates(path, exclude):
        log.append((list(path), set(exclude)))
        roots, scores = answers[len(path)]
        kept = [(r, s) for r, s in zip(roots, scores) if r not in exclude]
        return [r for r, _ in kept], [s for _, s in kept], [Draft() for _ in kept]

    return candidates


def test_a_draft_unlikely_to_go_on_is_assumed_rejected():
    draft = Draft([11, 12], [0, 1], [0.2, 0.1])  # a chain the model rarely takes
    log = []
    outcome = likeliest_outcome(draft, asked({3: ([50], [0.5]), 1: ([11, 40, 41], [0.2, 0.5, 0.3])}, log), 3)
    assert (outcome.path, outcome.roots, outcome.score) == ([0], [40, 41], pytest.approx(0.8))
    assert log == [([0, 1, 2], set()), ([0], {11})]  # the whole path, then the root; 0.2 cannot beat 0.8


def test_a_likely_draft_is_assumed_kept_whole():
    draft = Draft([11, 12], [0, 1], [0.9, 0.8])
    log = []
    answers = {3: ([50, 51], [0.6, 0.2]), 1: ([11, 40], [0.9, 0.1]), 2: ([12, 60], [0.8, 0.1])}
    outcome = likeliest_outcome(draft, asked(answers, log), 3)
    assert (outcome.path, outcome.roots, outcome.score) == ([0, 1, 2], [50, 51], pytest.approx(0.8 * 0.8))
    assert [path for path, _ in log] == [[0, 1, 2], [0], [0, 1]]
    assert likeliest_outcome(draft, asked(answers, []), 1).path == [0, 1, 2]  # one try: the whole path
    assert likeliest_outcome(Draft(), asked({1: ([], [])}, []), 3) is None  # nothing to guess
