"""Padding end to end (ClientConfig.pad_rows, threat T6): greedy output token-identical with and without it,
one block at a time and with blocks in flight, on tiny random models of several families and on the shipped
model; padded, every decode request and every reply has one size as the client's transport tap saw it."""

from __future__ import annotations

import pytest

from splitinfer.cloud.server import ServerThread
from splitinfer.decoding.draft import Draft
from splitinfer.decoding.strategies import Strategy
from splitinfer.errors import ConfigError
from splitinfer.clients import open_client
from splitinfer.local.client import SplitClient
from splitinfer.local.middle import RemoteMiddle
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_cloud

from tiny import hf_greedy, prepare_tiny

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71, 3, 17, 42, 5, 88]
N = 24
PAD = 8  # rows: above the largest block Varying sends


class Varying(Strategy):
    """Drafts 0-5 tokens of the known continuation by turns, the last one wrong every third step: blocks of
    1-6 rows and accepted counts that vary, which an unpadded stream shows in its sizes."""

    name = "varying"

    def __init__(self, text: list[int]):
        self.text, self.proposed = text, 0

    def propose(self, history):
        self.proposed += 1
        if history != self.text[: len(history)]:
            return Draft()
        tokens = self.text[len(history) : len(history) + self.proposed % 6]
        if tokens and self.proposed % 3 == 0:
            tokens[-1] = (tokens[-1] + 1) % 96
        return Draft(tokens=tokens, parents=list(range(len(tokens))), scores=[0.9] * len(tokens))

    def predict(self, history, nodes):
        return Draft(tokens=self.text[len(history) : len(history) + 1] or [history[-1]], parents=[0], scores=[0.5])


def tapped_client(shards, url: str, config: ClientConfig) -> tuple[SplitClient, list]:
    """A client whose every session records (direction, time, bytes) of each message it sends or receives."""
    client = open_client(shards / "local", url, config, allow_public_weights=True, checks=False)
    tap: list = []
    inner = client.make_middle

    def make():
        middle = inner()
        assert isinstance(middle, RemoteMiddle)
        middle.tap = tap
        return middle

    client.make_middle = make
    return client, tap


def decode_sizes(tap: list, steps: list[dict]) -> tuple[set[int], set[int]]:
    """The sizes of the decode requests and of every reply after the prompt's (one block in flight)."""
    first = 1 + sum(s["kind"] == "prefill" for s in steps)  # the hello, then the prompt's chunks
    ups = [n for d, _, n in tap if d == "up"][first : first + sum(s["kind"] == "decode" for s in steps)]
    downs = [n for d, _, n in tap if d == "down"][first:]
    return set(ups), set(downs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tmp_path_factory):
    model, shards = prepare_tiny(tmp_path_factory.mktemp("padding"), request.param, 2, 2)
    with ServerThread(load_cloud(shards / "cloud")) as server:
        yield shards, server, hf_greedy(model, PROMPT, N)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_padding_changes_no_token_and_hides_the_block_sizes(served, in_flight):
    shards, server, expected = served
    sizes = {}
    for pad in (0, PAD):
        config = ClientConfig(wire_dtype="float32", prefill_chunk=8, in_flight=in_flight, pad_rows=pad)
        client, tap = tapped_client(shards, server.url, config)
        for strategy in (Varying(PROMPT + expected), "tree", "sequential"):
            tap.clear()
            generation = client.generate(PROMPT, max_new_tokens=N, strategy=strategy, stop_ids=set())
            assert generation.token_ids == expected, (pad, strategy)
            if isinstance(strategy, Varying) and in_flight == 1:
                sizes[pad] = decode_sizes(tap, generation.steps)
    if in_flight == 1:
        assert len(sizes[0][0]) > 1 and len(sizes[0][1]) > 1  # unpadded: the sizes vary with the blocks
        assert len(sizes[PAD][0]) == 1 and sizes[PAD][1] == sizes[PAD][0]  # padded: one size, up and down


def test_padding_on_the_shipped_model_is_token_identical(smollm2_shards):
    prompt = "Write a Python function that returns the squares of a list of numbers."
    with ServerThread(load_cloud(smollm2_shards / "cloud")) as server:
        outputs = {}
        for pad in (0, 33):
            client, tap = tapped_client(smollm2_shards, server.url, ClientConfig(pad_rows=pad))
            generation = client.generate(prompt, max_new_tokens=48, strategy="tree")
            outputs[pad] = generation.token_ids
            ups, downs = decode_sizes(tap, generation.steps)
            if pad:
                assert len(ups) == 1 and downs == ups, (ups, downs)
        assert outputs[0] == outputs[33]


def test_prompt_padding_gives_prompts_of_any_length_under_it_one_size_and_changes_no_token(served):
    shards, server, expected = served
    padded, tap = tapped_client(shards, server.url, ClientConfig(wire_dtype="float32", pad_rows=PAD, pad_prompt_rows=64))
    plain, _ = tapped_client(shards, server.url, ClientConfig(wire_dtype="float32"))
    prompt_sizes = set()
    for prompt in (PROMPT[:3], PROMPT[:11], PROMPT):
        tap.clear()
        generation = padded.generate(prompt, max_new_tokens=4, strategy="tree", stop_ids=set())
        assert generation.token_ids == plain.generate(prompt, max_new_tokens=4, strategy="tree", stop_ids=set()).token_ids
        ups, downs = [n for d, _, n in tap if d == "up"], [n for d, _, n in tap if d == "down"]
        prompt_sizes.add((ups[1], downs[1]))  # the prompt's message (after the hello) and its reply
        assert ups[1] > ups[2]  # the prompt's ladder is above the steps' ladder
    assert generation.token_ids == expected[:4] and len(prompt_sizes) == 1


@pytest.mark.parametrize("steps", [4, 8])
def test_step_padding_makes_every_reply_a_multiple_of_exchanges_of_one_size(served, steps):
    """Replies of different lengths take different numbers of decode steps; with pad_steps the client adds
    cover exchanges the size of a padded step until the count is a multiple, and no token changes."""
    shards, server, expected = served
    config = ClientConfig(wire_dtype="float32", prefill_chunk=8, pad_rows=PAD, pad_steps=steps)
    client, tap = tapped_client(shards, server.url, config)
    counts = set()
    for n in (3, 9, N):
        tap.clear()
        generation = client.generate(PROMPT, max_new_tokens=n, strategy=Varying(PROMPT + expected), stop_ids=set())
        assert generation.token_ids == expected[:n]
        first = 1 + sum(s["kind"] == "prefill" for s in generation.steps)  # the hello, then the prompt's chunks
        downs = [b for d, _, b in tap if d == "down"][first:]
        ups = [b for d, _, b in tap if d == "up"][first : first + len(downs)]
        decoded = sum(s["kind"] == "decode" for s in generation.steps)
        assert len(downs) % steps == 0 and len(downs) >= decoded, (len(downs), decoded)
        assert generation.stats["cover_exchanges"] == len(downs) - decoded
        assert len(set(ups)) == 1 and set(downs) == set(ups), (set(ups), set(downs))
        counts.add(decoded)
    assert len(counts) > 1  # the replies took different numbers of steps, which the padding hid


def test_timing_padding_holds_every_reply_and_paces_every_send_without_changing_a_token(served):
    """--pad-hold-ms: no reply sooner than H ms after its step left; --pad-think-ms: no step sooner than T ms
    after the previous reply; cover exchanges keep both."""
    shards, server, expected = served
    hold, think = 60, 40
    config = ClientConfig(wire_dtype="float32", pad_rows=PAD, pad_steps=4, pad_hold_ms=hold, pad_think_ms=think)
    client, tap = tapped_client(shards, server.url, config)
    tap.clear()
    generation = client.generate(PROMPT, max_new_tokens=9, strategy=Varying(PROMPT + expected), stop_ids=set())
    assert generation.token_ids == expected[:9] and generation.stats["cover_exchanges"] > 0
    messages = tap[2:-1]  # after the hello and its welcome; the close is not answered
    ups, downs = messages[0::2], messages[1::2]
    assert all(d == "up" for d, _, _ in ups) and all(d == "down" for d, _, _ in downs)
    assert min(down[1] - up[1] for up, down in zip(ups, downs)) * 1e3 >= hold
    assert min(up[1] - down[1] for down, up in zip(downs, ups[1:])) * 1e3 >= think


def test_pacing_sends_needs_one_block_at_a_time():
    with pytest.raises(ConfigError, match="--in-flight 1"):
        ClientConfig(pad_think_ms=40, in_flight=2)
    with pytest.raises(ConfigError, match="--pad-hold-ms"):
        ClientConfig(pad_hold_ms=-1)
