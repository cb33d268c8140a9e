"""`logprobs` and `top_logprobs` through the official `openai` client, checked against the logits of the whole
model run sequentially (HF, float32), for chat and completions, streamed or not, greedy and sampled; and
every parameter the server does not implement refused with OpenAI's error body."""

from __future__ import annotations

import openai
import pytest
import torch

from splitinfer.api.engine import Engine
from splitinfer.api.server import ApiServer
from splitinfer.decoding.sampling import SamplingConfig
from splitinfer.local.client import SplitClient
from splitinfer.local.session import ClientConfig
from splitinfer.model.shards import load_whole_hf

MODEL = "tiny-chat"
HELLO = [{"role": "user", "content": "hello there"}]
TOP = 4


@pytest.fixture(scope="module")
def split_client(chat_shards, cloud_server):
    return SplitClient.connect(chat_shards / "local", cloud_server.url, ClientConfig(wire_dtype="float32"),
                               allow_public_weights=True)


@pytest.fixture(scope="module")
def whole(chat_shards):
    return load_whole_hf(chat_shards).eval()


@pytest.fixture(scope="module")
def api(split_client):
    engine = Engine(split_client, MODEL, max_concurrent=2)
    with ApiServer(engine, port=0) as server:
        yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120), engine


def sequential_logprobs(whole, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the log-softmax of the rows that predicted each token, one full forward."""
    with torch.inference_mode():
        logits = whole(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_entries(entries, tokens: list[int], reference: torch.Tensor, tokenizer) -> None:
    """Each entry's token, logprob and alternatives against the sequential run's rows."""
    assert len(entries) == len(tokens) > 0
    for entry, token, row in zip(entries, tokens, reference):
        assert bytes(entry.bytes) == tokenizer.decode([token]).encode()
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        values, ids = torch.topk(row, TOP)
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [alt.token for alt in entry.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]


def visible(tokens: list[int], stop_ids: set[int]) -> list[int]:
    return [t for t in tokens if t not in stop_ids]


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_chat_logprobs_match_a_sequential_run_streamed_or_not(api, split_client, whole, temperature):
    oc, engine = api
    ids = engine.chat_ids(HELLO)
    sampling = SamplingConfig(temperature, 0, 1.0, 7) if temperature else None
    ref = split_client.generate(ids, max_new_tokens=20, chat=False, strategy="sequential", sampling=sampling)
    tokens = visible(ref.token_ids, split_client.stop_ids())
    reference = sequential_logprobs(whole, ids, ref.token_ids)[: len(tokens)]
    args = dict(model=MODEL, messages=HELLO, max_tokens=20, temperature=temperature, seed=7, logprobs=True,
                top_logprobs=TOP)
    reply = oc.chat.completions.create(**args)  # the default strategy: speculative (tree)
    assert reply.choices[0].message.content == ref.text
    check_entries(reply.choices[0].logprobs.content, tokens, reference, engine.tokenizer)
    chunks = [c for c in oc.chat.completions.create(**args, stream=True) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    check_entries(streamed, tokens, reference, engine.tokenizer)
    # Each chunk carries the entries of the tokens behind its own text (special tokens add no text).
    at = 0
    for c in chunks:
        if c.choices[0].delta.content:
            n = len(c.choices[0].logprobs.content)
            assert engine.tokenizer.decode(tokens[at : at + n], skip_special_tokens=True) == c.choices[0].delta.content
            at += n
    assert at == len(tokens)


def test_completion_logprobs_in_the_legacy_form(api, split_client, whole):
    oc, engine = api
    ids = engine.prompt_ids("the cat sat")
    ref = split_client.generate(ids, max_new_tokens=16, chat=False, strategy="sequential")
    tokens = visible(ref.token_ids, split_client.stop_ids())
    reference = sequential_logprobs(whole, ids, ref.token_ids)[: len(tokens)]
    for stream in (False, True):
        if stream:
            parts = [c.choices[0].logprobs for c in oc.completions.create(
                model=MODEL, prompt="the cat sat", max_tokens=16, temperature=0, logprobs=TOP, stream=True)
                if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
            got = {k: [x for part in parts for x in getattr(part, k)] for k in
                   ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        else:
            c = oc.completions.create(model=MODEL, prompt="the cat sat", max_tokens=16, temperature=0, logprobs=TOP)
            assert c.choices[0].text == ref.text
            got = {k: getattr(c.choices[0].logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert "".join(got["tokens"]) == ref.text
        assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(tokens))]
        assert got["token_logprobs"] == pytest.approx([float(r[t]) for r, t in zip(reference, tokens)], abs=1e-4)
        for alts, row in zip(got["top_logprobs"], reference):
            values, top_ids = torch.topk(row, TOP)
            assert alts == pytest.approx({engine.tokenizer.decode([i]): v for i, v in zip(top_ids.tolist(), values.tolist())},
                                         abs=1e-4)


def test_no_logprobs_unless_asked_and_bad_values_refused(api):
    oc, _ = api
    plain = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    for bad, param in (({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as err:
            oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **bad)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=6)


@pytest.mark.parametrize("extra, code", [
    ({"presence_penalty": 0.5}, "unsupported_parameter"),
    ({"frequency_penalty": -1}, "unsupported_parameter"),
    ({"logit_bias": {"5": 10}}, "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported_parameter"),
    ({"n": 2}, "invalid_value"),
    ({"stream_options": {"include_obfuscation": True}}, "unsupported_parameter"),
    ({"temprature": 0}, "unknown_parameter"),
])
def test_parameters_not_implemented_are_refused_not_ignored(api, extra, code):
    oc, _ = api
    with pytest.raises(openai.BadRequestError) as err:
        oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body=extra)
    assert err.value.body["code"] == code and err.value.body["param"] == next(iter(extra))
    assert "penalties are not implemented" in err.value.body["message"] or "penalty" not in next(iter(extra))


def test_message_fields_other_than_role_and_content_are_refused_unless_empty(api):
    oc, _ = api
    with pytest.raises(openai.BadRequestError) as err:
        oc.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi", "name": "bob"}])
    assert err.value.body["param"] == "messages[0].name" and err.value.body["code"] == "unsupported_parameter"
    first = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    echoed = first.choices[0].message.model_dump()  # role, content and null or empty fields, as an SDK returns them
    again = oc.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       messages=[*HELLO, echoed, {"role": "user", "content": "and?"}])
    assert again.choices[0].finish_reason in ("stop", "length")


def test_no_op_values_of_unimplemented_parameters_are_accepted(api):
    oc, _ = api
    r = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0, presence_penalty=0,
                                   frequency_penalty=0.0, n=1, logit_bias={}, response_format={"type": "text"},
                                   user="someone")
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        oc.completions.create(model=MODEL, prompt="abc", max_tokens=4, echo=True)
    assert err.value.body["param"] == "echo"
