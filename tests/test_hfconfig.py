"""hfconfig.py: a model config's optional fields, named or not, read the same for both sides."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig

from splitinfer.hfconfig import context_limit, eos_ids


def test_eos_ids_none_one_or_several():
    assert eos_ids(PretrainedConfig()) == frozenset()
    assert eos_ids(LlamaConfig(eos_token_id=2)) == {2}
    assert eos_ids(LlamaConfig(eos_token_id=[2, 7])) == {2, 7}


def test_the_context_limit_where_the_config_names_one():
    assert context_limit(LlamaConfig(max_position_embeddings=96)) == 96
    assert context_limit(PretrainedConfig()) is None
