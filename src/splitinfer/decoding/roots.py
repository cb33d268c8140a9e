"""Blocks with several candidate roots: what a block sent ahead carries (pure functions; no model, no network).

A block sent ahead (loop.py) cannot know the token the block before it will choose after its kept rows.
Instead of betting on one guess it carries N candidate roots, siblings at the same position: block rows
0..N-1 have parent -1 (so they see the committed and assumed rows and themselves only), likeliest first,
and after them each root's draft, root by root:

    rows  0 .. N-1                      the roots r_0 .. r_{N-1}        (parent -1, depth 0)
    rows  N .. N+|d_0|-1                r_0's draft                     (parents among r_0's rows)
    rows  ...                           r_1's draft, then r_2's, ...

A one-root block is laid out exactly as `Draft.to_block` lays it out. When the earlier block resolves,
the root equal to the token it chose (if any) is the block's real root; its rows form an ordinary
one-root block (`own_rows`), accepted with the same `accept` as any other block, and its path is
mapped back to block rows for the keep list (a path whose first row need not be row 0).

The candidates come from `Strategy.predict`: its tree below the assumed text, whose first level is the
ranked next tokens with calibrated scores and whose deeper nodes are a small draft below each of them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..masks import BlockStructure
from .draft import Block, Draft, children_of


def top_path(draft: Draft) -> list[int]:
    """The draft's most likely accepted path, as rows of its own block (row 0 its root): from the root, always
    the child with the best score."""
    children = children_of([0, *draft.tokens], [-1, *draft.parents])
    path = [0]
    while children.get(path[-1]):
        path.append(max(children[path[-1]].values(), key=lambda row: draft.scores[row - 1]))
    return path


@dataclass(frozen=True)
class Outcome:
    """What a block is assumed to resolve to: the rows it keeps, then one of several tokens."""

    path: list[int]  # the rows kept, as rows of the draft's own block (row 0 its root)
    roots: list[int]  # the candidates for the token chosen after them, likeliest first
    scores: list[float]  # each candidate's calibrated chance
    below: list[Draft]  # a predicted draft below each candidate
    score: float  # the chance that exactly these rows are kept and one of the candidates is chosen


Candidates = Callable[[list[int], set[int]], tuple[list[int], list[float], list[Draft]]]


def likeliest_outcome(draft: Draft, candidates: Candidates, tries: int) -> Outcome | None:
    """Which rows of a block to assume kept: its draft's whole top path, or a prefix of it where the draft is
    unlikely to go on. Acceptance stops at row r and then chooses token x with probability
    P(reach r) P(x | r) for any x that is not one of r's children's tokens, so a prefix ending at r scores
    P(reach r) times its candidates' summed scores (children's tokens excluded; at most 1).
    candidates(path, excluded tokens) -> (roots, scores, drafts) asks the strategy. Tries the whole path,
    then the prefixes from the root on while their reach can still beat the best, `tries` at most."""
    path = top_path(draft)
    children = children_of([0, *draft.tokens], [-1, *draft.parents])
    best = None
    for tried, cut in enumerate([len(path), *range(1, len(path))]):
        reach = draft.scores[path[cut - 1] - 1] if cut > 1 else 1.0
        if tried >= tries or (best is not None and reach <= best.score):
            break
        own = path[:cut]
        roots, scores, below = candidates(own, set(children.get(own[-1], {})))
        score = reach * min(sum(scores), 1.0)
        if roots and (best is None or score > best.score):
            best = Outcome(own, roots, scores, below, score)
    return best


def candidate_roots(
    predicted: Draft, max_roots: int, floor: float, nodes: int, exclude: Collection[int] = ()
) -> tuple[list[int], list[float], list[Draft]]:
    """(tokens, scores, drafts) of the likeliest next tokens in a predicted tree: its first level but the
    tokens in `exclude`, each at least `floor` likely, at most `max_roots`, likeliest first; below each
    root, its best `nodes` predicted nodes as a draft whose scores are given that root."""
    first = sorted((n for n in range(len(predicted)) if predicted.parents[n] == 0), key=lambda n: -predicted.scores[n])
    first = [n for n in first if predicted.scores[n] >= floor and predicted.tokens[n] not in exclude][:max_roots]
    top = {}  # predicted row -> the first-level row above it (itself for a first-level row)
    for n, parent in enumerate(predicted.parents):
        top[n + 1] = n + 1 if parent == 0 else top[parent]
    drafts = [_below(predicted, n + 1, [m for m in range(len(predicted)) if top[m + 1] == n + 1 and m != n], nodes)
              for n in first]
    return [predicted.tokens[n] for n in first], [predicted.scores[n] for n in first], drafts


def _below(predicted: Draft, root: int, under: list[int], nodes: int) -> Draft:
    """The best `nodes` of the predicted nodes `under` (breadth-first, all below row `root`) as a draft below
    that root. Scores never rise from parent to child, so the best nodes include their ancestors; ties keep
    the breadth-first order, parents first."""
    best = set(sorted(under, key=lambda m: -predicted.scores[m])[:nodes])
    given = max(predicted.scores[root - 1], 1e-9)
    row = {root: 0}
    draft = Draft()
    for m in under:
        if m not in best or predicted.parents[m] not in row:
            continue
        row[m + 1] = len(draft.tokens) + 1
        draft.tokens.append(predicted.tokens[m])
        draft.parents.append(row[predicted.parents[m]])
        draft.scores.append(min(predicted.scores[m] / given, 1.0))
        draft.sources.append(predicted.sources[m] if predicted.sources else "")
        draft.keys.append(predicted.keys[m] if predicted.keys else None)
        draft.proposers.append(predicted.proposers[m] if predicted.proposers else ())
    return draft


def multi_root_block(roots: list[int], drafts: list[Draft]) -> tuple[Block, list[list[int]]]:
    """One block holding every root and its draft (layout above); returns it and each root's own rows (its
    root row, then its draft's nodes in order)."""
    assert roots and len(roots) == len(drafts), (roots, len(drafts))
    if len(roots) == 1:
        return drafts[0].to_block(roots[0]), [list(range(len(drafts[0]) + 1))]
    tokens, parents, rows = list(roots), [-1] * len(roots), []
    for i, draft in enumerate(drafts):
        assert draft.side is None or not draft.side.tokens, "side rows belong to one-root blocks"
        own = [i] + list(range(len(tokens), len(tokens) + len(draft)))
        tokens += draft.tokens
        parents += [own[p] for p in draft.parents]
        rows.append(own)
    return Block(tokens, parents, BlockStructure.tree(parents), None), rows
