"""Families beyond Llama: Gemma 3 (sliding and global layers, two rotary tables, q/k norms, a scaled
embedding, 1 + weight norms), Qwen3 (q/k norms) and Llama 3 rope scaling. Split greedy decoding equals the
monolithic HF model's greedy decoding, in-process, over a WebSocket and with speculative tree blocks."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.server import ServerThread
from splitinfer.decoding.draft import Draft
from splitinfer.decoding.strategies import Strategy, Tree, TreeConfig
from splitinfer.clients import open_client
from splitinfer.local.session import ClientConfig
from splitinfer.masks import attention_mask, tree_allowed, tree_depths
from splitinfer.model.shards import load_cloud, load_local

from tiny import GEMMA3_LAYER_TYPES, GEMMA3_WINDOW, assert_local_only_matches_hf, hf_greedy, min_margin, prepare_tiny

# Four times Gemma's tiny window, with a repeat so the tree strategies find drafts.
PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71] * 2
NEW_TOKENS = 24


class WrongFirst(Strategy):
    """Knows the true continuation; every block puts a wrong sibling before the right chain, so accepted
    rows are never a block prefix and kept cache rows move."""

    name = "wrong-first"

    def __init__(self, prompt_len: int, truth: list[int], depth: int = 3):
        self.prompt_len, self.truth, self.depth = prompt_len, truth, depth

    def propose(self, history):
        done = len(history) - self.prompt_len
        nxt = self.truth[done : done + self.depth]
        if not nxt:
            return Draft()
        wrong = (nxt[0] + 1) % 96
        tokens = [wrong, nxt[0], (wrong + 5) % 96, *nxt[1:]]
        right_rows = [2] + list(range(4, 4 + len(nxt) - 1))
        return Draft(tokens=tokens, parents=[0, 0, 1] + right_rows[:-1], scores=[0.5] * len(tokens))


# Gemma 3 layer types are S S G S S G: head/tail depths put the cut inside a run of sliding layers, on
# the boundary between a sliding and a global layer, and put a global layer on either side.
GEMMA3_SPLITS = [(1, 1), (2, 1), (3, 2), (1, 3), (4, 1)]


@pytest.mark.parametrize("head,tail", GEMMA3_SPLITS)
def test_gemma3_local_only_matches_hf_generate(tmp_path, head, tail):
    model, shards = prepare_tiny(tmp_path, "gemma3", head, tail)
    assert_local_only_matches_hf(model, shards, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama3"])
def test_split_over_websocket_matches_hf_generate(tmp_path, family):
    model, shards = prepare_tiny(tmp_path, family, 2, 2)
    expected = hf_greedy(model, PROMPT, NEW_TOKENS)
    assert min_margin(model, PROMPT, expected) > 1e-3
    # Prefill chunks shorter than the prompt but longer than Gemma's window: a chunk's sliding layers see
    # keys of the chunk before, and not those further back.
    config = ClientConfig(wire_dtype="float32", prefill_chunk=8)
    with ServerThread(load_cloud(shards / "cloud")) as server:
        client = open_client(shards / "local", server.url, config, allow_public_weights=True, checks=False)
        sequential = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy="sequential")
        oracle = client.generate(
            PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy=WrongFirst(len(PROMPT), expected)
        )
        tree = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=set(), strategy=Tree(TreeConfig(fixed_nodes=12)))
    assert sequential.token_ids == expected
    assert sequential.stats["prefill_messages"] == 4
    assert oracle.token_ids == expected and tree.token_ids == expected
    assert oracle.stats["mean_accepted_per_step"] > 2.0  # drafts were accepted past rejected siblings


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("head,tail", [(1, 1), (3, 2)])
def test_local_only_matches_hf_generate(tmp_path, family, head, tail):
    model, shards = prepare_tiny(tmp_path, family, head, tail)
    assert_local_only_matches_hf(model, shards, PROMPT, NEW_TOKENS)


def test_gemma3_tree_block_rows_match_monolithic_paths(tmp_path):
    """Each row of a tree block far past the window gets the logits the whole model gives its path.

    A deep branch puts rows at positions that differ by more than the window from the committed keys, so
    every row's sliding layers drop a different set of committed keys."""
    model, shards = prepare_tiny(tmp_path, "gemma3", 2, 2)
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    prompt = PROMPT[:20]
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 1]  # a chain of 8 and two side branches
    tokens = [11, 23, 35, 47, 59, 61, 73, 85, 29, 31, 90]
    assert max(tree_depths(parents)) > GEMMA3_WINDOW
    caches = (local.head.new_cache(), cloud.stack.new_cache(), local.tail.new_cache())
    stacks = (local.head, cloud.stack, local.tail)

    def run(ids, positions, allowed):
        hidden = local.embed(torch.tensor([ids]))
        for stack, cache in zip(stacks, caches):
            hidden = stack(hidden, positions, allowed, cache)
            cache.commit_all()
        return local.logits(hidden)

    run(prompt, torch.arange(len(prompt)), tree_allowed([-1] + list(range(len(prompt) - 1))))
    depths = torch.tensor(tree_depths(parents))
    got = run(tokens, len(prompt) + depths, tree_allowed(parents))
    for row in range(len(tokens)):
        path, node = [], row
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        with torch.no_grad():
            want = model(torch.tensor([prompt + path])).logits[0, -1]
        assert torch.allclose(got[row], want, atol=1e-4), row


def test_gemma3_sliding_layers_get_windowed_masks_and_local_rope(tmp_path):
    """The stack gives sliding layers the window and the local rope table, global layers neither."""
    _, shards = prepare_tiny(tmp_path, "gemma3", 2, 2)
    cloud = load_cloud(shards / "cloud")
    assert cloud.stack.windows == [None, GEMMA3_WINDOW]  # layers 2 (global) and 3 (sliding)
    assert cloud.stack.rope_keys == GEMMA3_LAYER_TYPES[2:4]
    # A mask with the window differs from one without once the context is longer than the window.
    args = (20, torch.tensor([20]), tree_allowed([-1]), torch.float32)
    assert not torch.equal(attention_mask(*args, window=GEMMA3_WINDOW), attention_mask(*args))


def test_gemma3_embedding_is_scaled_and_norm_uses_one_plus_weight(tmp_path):
    model, shards = prepare_tiny(tmp_path, "gemma3", 1, 1)
    local = load_local(shards / "local")
    ids = torch.tensor([[3, 17, 42]])
    with torch.no_grad():
        want = model.model.embed_tokens(ids)
        assert torch.allclose(want, model.model.embed_tokens.weight[ids] * 64**0.5)
        assert torch.equal(local.embed(ids), want)
        x = torch.randn(1, 3, 64)
        assert torch.allclose(local.norm(x), model.model.norm(x))
