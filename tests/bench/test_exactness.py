"""bench exactness: the in-process wire rounds as the wire's encoding does, and a configuration measured
against the float32 reference reports what differs (tiny random Llama, float32 shards)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from splitinfer.bench import exactness
from splitinfer.errors import ConfigError
from splitinfer.inprocess import InProcessMiddle, load_halves
from splitinfer.local.config import ClientConfig
from splitinfer.local.session import SplitSession

from tiny import prepare_tiny

IDS = [3, 17, 9, 40, 2, 11, 25, 7, 30, 5, 12, 8]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepare_tiny(tmp_path_factory.mktemp("exactness"), "llama", 2, 2)[1]


def _prefill(halves, wire: str | None) -> torch.Tensor:
    local, cloud = halves
    middle = InProcessMiddle(cloud, None, wire_dtype=wire)
    with SplitSession(local, middle, ClientConfig(wire_dtype=wire or "float32")) as session:
        return session.prefill(IDS, logits_rows=len(IDS))


@torch.inference_mode()
def _chained(halves, wire: torch.dtype) -> torch.Tensor:
    """The halves chained by hand, the hidden states rounded to `wire` at both crossings."""
    local, cloud = halves
    n = len(IDS)
    allowed, positions = np.tril(np.ones((n, n), bool)), torch.arange(n)
    hidden = local.embed(torch.tensor([IDS]))
    for i, stack in enumerate((local.head, cloud.stack, local.tail)):
        if i:
            hidden = hidden.to(wire).float()
        hidden = stack(hidden, positions, allowed, stack.new_cache())
    return local.logits(hidden)


def test_the_in_process_wire_rounds_both_crossings_as_the_encoding_does(shards):
    halves = load_halves(shards)
    plain, f32, f16 = _prefill(halves, None), _prefill(halves, "float32"), _prefill(halves, "float16")
    assert torch.equal(plain, f32)  # float32's encoding is lossless
    assert not torch.equal(plain, f16)
    torch.testing.assert_close(f16, _chained(halves, torch.float16).reshape(f16.shape), rtol=0, atol=1e-5)


def test_a_configuration_against_the_reference_reports_agreement_and_tree_exactness(shards):
    halves = load_halves(shards)
    texts, prompts = [IDS, IDS[::-1]], {"a": IDS[:5], "b": IDS[4:]}
    options = exactness.ExactnessOptions(tokens=6, strategy="tree-nohead")
    reference = exactness.Reference(exactness.split_client(shards, halves, "float32"), texts, prompts, options.tokens)
    same = exactness.measure(exactness.split_client(shards, halves, "float32"), reference, texts, prompts, options)
    assert same["perplexity_vs_reference"] == 0 and same["top1_agreement"] == 1 == same["top1_along_replies"]
    assert same["identical_replies"] == 2 == same["tree_equals_sequential"]
    rounded = exactness.measure(exactness.split_client(shards, halves, "bfloat16"), reference, texts, prompts, options)
    assert rounded["perplexity_vs_reference"] != 0  # bfloat16 keeps 8 bits of mantissa: the numbers move
    assert rounded["tree_equals_sequential"] == 2
    for reply in rounded["replies"]:
        assert reply["identical"] == (reply["first_divergence"] is None) != ("reference_margin" in reply)
    text = "\n".join(exactness.markdown({"options": {"tokens": 6, "strategy": "tree-nohead"},
                                         "reference": {"perplexity": 1.0}, "rows": [{"weights": "float32", "wire": "bfloat16", **rounded}]}))
    assert "| float32 | bfloat16 |" in text


@pytest.mark.parametrize("formats, wires, message", [("int8", "float16", "include float32"),
                                                     ("float32", "float8", "unknown wire dtype float8")])
def test_bad_options_say_what_to_do(formats, wires, message):
    args = argparse.Namespace(**{**vars(argparse.Namespace(**exactness.ExactnessOptions().__dict__)),
                                 "formats": formats, "wires": wires, "model": None, "out": "unused"})
    with pytest.raises(ConfigError, match=message):
        exactness.run(args)
