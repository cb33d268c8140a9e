"""Tiny random models of several families, built from configs with a fixed seed (nothing downloaded), and the
comparison every exactness test makes: split greedy decoding against HF greedy on the whole model."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from splitinfer.clients import open_client
from splitinfer.model.prepare import prepare
from splitinfer.model.source import SourceModel

THREADS = min(2, os.cpu_count() or 1)  # torch threads of every test (tests that change it put it back)
torch.set_num_threads(THREADS)

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=20_000,
    tie_word_embeddings=False,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    # A small sliding window so generation runs past it and the windowed mask is exercised.
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=12),
    "qwen2": lambda: Qwen2Config(**{**COMMON, "tie_word_embeddings": True}),
    # q/k norms on every attention head.
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
    # Llama 3 frequency-dependent rope scaling; a short original context so most frequencies are rescaled.
    "llama3": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "gemma3": lambda: gemma3_config(),
}

# Gemma 3's pattern at a tiny scale: two sliding layers then one global, twice. A window of 6 is far
# shorter than the prompts, so sliding layers drop keys a global layer still sees.
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
GEMMA3_WINDOW = 6


def gemma3_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        **{**COMMON, "tie_word_embeddings": True},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=GEMMA3_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    )


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = TINY_CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    # Larger weights than the default init give peaked logits, so greedy choices are not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def prepare_tiny(tmp_path: Path, family: str, head: int, tail: int, seed: int = 0):
    model = tiny_model(family, seed)
    out = tmp_path / f"{family}-{head}-{tail}"
    prepare(SourceModel(f"tiny-{family}", model.config, model, None), out, head, tail, "float32")
    return model, out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The whole HF model's own greedy `generate`: n new tokens, no stop token."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def min_margin(model, prompt: list[int], tokens: list[int]) -> float:
    """Smallest top-1 minus top-2 logit gap along the continuation `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def assert_local_only_matches_hf(model, shards: Path, prompt: list[int], n: int) -> None:
    """Split greedy decoding in one process (shards prepared from `model`) equals HF greedy, token for token."""
    expected = hf_greedy(model, prompt, n)
    assert min_margin(model, prompt, expected) > 1e-3  # the comparison is meaningful, not a tie
    got = open_client(local_only=True, shards=shards).generate(prompt, max_new_tokens=n, stop_ids=set())
    assert got.token_ids == expected


def random_head(local, seed: int = 0, vocab: int | None = None, fused_layers: tuple[int, ...] = ()):
    """A randomly initialised draft head over a LocalHalf's own embedding, final norm and LM head; its draft
    vocabulary is the first `vocab` ids (all by default). With `fused_layers`, its fuse projection is random
    too (not the zeros training starts from)."""
    from splitinfer.model.drafthead import DraftHead, DraftHeadConfig

    torch.manual_seed(seed)
    size = vocab or local.config.vocab_size
    config = DraftHeadConfig.for_model(local.config, size, intermediate_size=32, fused_layers=fused_layers)
    head = DraftHead(config, local.embed, local.norm, local.lm_head, torch.arange(size))
    if fused_layers:
        torch.nn.init.normal_(head.fuse.weight, std=0.05)
    return head.eval().requires_grad_(False)


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """96 ids: <eos> = 0, then printable ASCII 32..125 and a newline; one character per token."""
    chars = [chr(c) for c in range(32, 126)] + ["\n"]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    inner.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", unk_token="?")
    tok.chat_template = CHAT_TEMPLATE
    return tok
