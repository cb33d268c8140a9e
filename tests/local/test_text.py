"""Streamed text: the incremental decoder (tokenizers' DecodeStream) gives the pieces the whole-reply decode
gave, on multi-byte characters split across tokens and on the benchmark prompts' stored replies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from splitinfer.local.text import TextStream

TEXTS = ("Hello, world! naïve café", "emoji 🙂🚀 and a family 👨‍👩‍👧 in a row", "中文字符和日本語のテキスト",
         "mixed: αβγ 😀 漢字 end", "line\nbreaks\tand  spaces ")
STORED_RUN = Path(__file__).parents[2] / "notes" / "bench" / "readme" / "speculative.json"


def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style: one token per byte, so every multi-byte character is split across tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def byte_fallback() -> PreTrainedTokenizerFast:
    """Llama / Gemma style: sentencepiece pieces with <0xNN> byte tokens for what the vocabulary lacks."""
    vocab = {"<unk>": 0, "\u2581": 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for ch in "abcdefghijklmnopqrstuvwxyzHW,!.:":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def pieces(tokenizer, ids, incremental: bool, stops=(), eos=None):
    out: list[str] = []
    stream = TextStream(tokenizer, out.append, stop_ids={eos} if eos is not None else set(), stop_strings=stops)
    if not incremental:
        stream.incremental = None  # the whole reply decoded again for every token, as before DecodeStream
    for token in ids:
        if stream.push(token):
            break
    return out, stream.finish()


def assert_same(tokenizer, ids, **kw):
    new, new_text = pieces(tokenizer, ids, True, **kw)
    old, old_text = pieces(tokenizer, ids, False, **kw)
    assert (new, new_text) == (old, old_text)
    return new, new_text


@pytest.mark.parametrize("make", [byte_level, byte_fallback])
@pytest.mark.parametrize("text", TEXTS)
def test_split_multibyte_characters_stream_as_before(make, text):
    tokenizer = make()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.encode()) // 4  # characters really are split across tokens
    new, final = assert_same(tokenizer, ids)
    assert "".join(new) == final == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in new)  # no half character is ever passed on


def test_stop_strings_and_end_of_sequence_cut_as_before():
    tokenizer = byte_level()
    ids = tokenizer("one 🙂 two 中文 three", add_special_tokens=False)["input_ids"]
    _, text = assert_same(tokenizer, ids, stops=("two",))
    assert text == "one 🙂 "
    eos = ids[8]
    assert_same(tokenizer, ids + [eos], eos=eos)


def test_the_incremental_decoder_is_used_for_a_fast_tokenizer():
    assert TextStream(byte_level(), print).incremental is not None


@pytest.mark.slow
def test_the_benchmark_prompts_replies_stream_as_before(smollm2_shards):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_shards / "local")
    run = json.loads(STORED_RUN.read_text())
    replies = {tuple(r["token_ids"]) for r in run["runs"] + run.get("local_only_runs", [])}
    assert len(replies) >= 15
    for ids in replies:
        new, final = assert_same(tokenizer, list(ids))
        assert "".join(new) == final
