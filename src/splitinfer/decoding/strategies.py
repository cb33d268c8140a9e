"""The decoding strategies by name (what a strategy is: strategy.py).

    sequential   no draft: one token per round trip (the reference; strategy.py)
    jacobi       a chain of guesses refined by iteration (kept for comparison; baselines.py)
    lookahead    the paper's n-gram lookahead (kept for comparison; baselines.py)
    tree         the default: suffix index, Token Recycling and the learned draft head in one tree (tree.py)
    tree-nohead  the same without the head
"""

from __future__ import annotations

from .baselines import Jacobi, JacobiConfig, Lookahead, LookaheadConfig
from .controller import StepCosts
from .strategy import Sequential, Strategy
from .tree import Tree, TreeConfig
from .warm import RecyclingTable, SuffixMemory

__all__ = ["STRATEGIES", "Jacobi", "JacobiConfig", "Lookahead", "LookaheadConfig", "Sequential", "Strategy", "Tree",
           "TreeConfig", "make_strategy"]

# "tree-nohead": the tree without the learned draft head even where the client has one (for comparisons).
STRATEGIES = {"sequential": Sequential, "jacobi": Jacobi, "lookahead": Lookahead, "tree": Tree, "tree-nohead": Tree}


def make_strategy(
    name: str, costs: StepCosts | None = None, memory: SuffixMemory | None = None,
    recycling_table: RecyclingTable | None = None, head=None,
) -> Strategy:
    """A fresh strategy by name; `costs` (a client's measured step costs) goes to those that size blocks,
    `memory` and `recycling_table` (warm starts, warm.py) and `head` (a learned draft head, when the client
    has one) to those that draft from them."""
    if name in ("tree", "tree-nohead"):
        return Tree(costs=costs, memory=memory, recycling_table=recycling_table,
                    head=head if name == "tree" else None)
    return STRATEGIES[name]()
