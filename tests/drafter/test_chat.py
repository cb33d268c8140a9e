"""The chat corpus (drafter/chat.py) and its teacher-forced shards (drafter/teacher.py), on synthetic
conversations, a tiny random Llama and a character tokenizer: no dataset wheel needed."""

from __future__ import annotations

import json

import pytest
import torch

from splitinfer.drafter import chat, teacher
from splitinfer.drafter.unroll import path_tokens, path_valid
from splitinfer.errors import ConfigError

from tiny import char_tokenizer, tiny_model

HAWAII = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
          "must-see attractions.")


def conversation(cid: str, *turns: str, first: str = "human") -> dict:
    speakers = ["human", "gpt"] if first == "human" else ["gpt", "human"]
    return {"id": cid, "conversations": [{"from": speakers[i % 2], "value": t} for i, t in enumerate(turns)]}


ENGLISH = ("It is the time of year when the garden needs you and the soil is warm, so plant the seeds in a row and "
           "water them.")


def test_read_sharegpt_stops_at_the_cut_and_says_so(tmp_path):
    items = [conversation(str(i), "Hello there, how are you?", ENGLISH) for i in range(3)]
    whole = json.dumps(items, indent=2)
    (tmp_path / "whole.json").write_text(whole)
    (tmp_path / "cut.json").write_text(whole[: whole.rindex('"id"') + 20])
    assert chat.read_sharegpt(tmp_path / "whole.json") == (items, {"read": 3, "cut": False})
    assert chat.read_sharegpt(tmp_path / "cut.json") == (items[:2], {"read": 2, "cut": True})
    assert chat.read_sharegpt(tmp_path / "whole.json", limit=1)[0] == items[:1]


def test_messages_start_at_the_first_user_turn_and_stop_at_a_stranger():
    convo = conversation("a", "the end of an earlier piece", "a question", "an answer", first="gpt")
    assert chat.messages(convo) == [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}]
    convo["conversations"].append({"from": "bing", "value": "x"})
    convo["conversations"].append({"from": "human", "value": "y"})
    assert len(chat.messages(convo)) == 2


def test_usable_leaves_out_every_conversation_on_an_evaluated_topic():
    evaluated = chat.Evaluated.load([HAWAII])
    conversations = [
        conversation("on-topic", "Write a blog post about my recent trip to Hawaii: the cultural experiences and the "
                     "attractions nobody should miss.", ENGLISH),
        conversation("copied", "Please help. " + HAWAII.lower(), ENGLISH),
        conversation("later-turn", "Hi! I have a question for you.", ENGLISH, "Could you compose a travel blog post "
                     "about Hawaii's cultural experiences and attractions?", ENGLISH),
        conversation("kept", "How do I keep tomato plants healthy in a small garden?", ENGLISH),
        conversation("french", "Comment vas-tu aujourd'hui, mon ami ? Je voudrais des conseils.", "Très bien, merci "
                     "beaucoup ! Voici quelques idées pour la journée, avec des détails précis."),
        conversation("no-reply", "Is anyone there?"),
    ]
    kept, counts = chat.usable(conversations, evaluated)
    assert [k["id"] for k in kept] == ["kept"]
    assert counts == {"read": 6, "no_reply": 1, "not_english": 1, "on_evaluated_topic": 3, "kept": 1}
    # The packaged benchmark and held-out prompts are always evaluated, with or without MT-Bench.
    benchmark = chat.Evaluated.load()
    assert chat.overlaps("Can you tell me: " + chat.evaluation_prompts()[0], benchmark)
    assert chat.is_heldout("x") == chat.is_heldout("x")
    assert 0.005 < sum(chat.is_heldout(str(i)) for i in range(4000)) / 4000 < 0.04  # 2% by id


CONVERSATIONS = [
    {"id": str(i), "heldout": i == 3, "messages": [
        {"role": "user", "content": f"question {i}: why?"}, {"role": "assistant", "content": "because " * (1 + i % 3)},
        {"role": "user", "content": "and then?"}, {"role": "assistant", "content": f"then {i}."}]}
    for i in range(8)
]


def test_a_conversation_renders_with_its_assistant_text_marked():
    tok = char_tokenizer()
    ids, draft = teacher.conversation_ids(tok, CONVERSATIONS[1]["messages"], 1000)
    assert tok.decode(ids) == "u:question 1: why?<eos>\na:because because <eos>\nu:and then?<eos>\na:then 1.<eos>\n"
    drafted = tok.decode([t for t, d in zip(ids, draft) if d])
    assert drafted == "because because <eos>\nthen 1.<eos>\n"
    cut, cut_draft = teacher.conversation_ids(tok, CONVERSATIONS[1]["messages"], 24)
    assert cut == ids[:24] and cut_draft == draft[:24]
    assert teacher.conversation_ids(tok, CONVERSATIONS[1]["messages"], 10) is None  # no reply before the cut


def _collect(tmp_path, name, tokens, fail_after=None, monkeypatch=None, fused_layers=()):
    model = tiny_model("llama", seed=5)
    config = teacher.TeacherConfig(tokens=tokens, shard_tokens=120, batch_tokens=256, chunk_tokens=100,
                                   fused_layers=fused_layers)
    if fail_after is not None:
        real, calls = teacher.label, {"n": 0}

        def failing(*args):
            calls["n"] += 1
            if calls["n"] > fail_after:
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(teacher, "label", failing)
        with pytest.raises(KeyboardInterrupt):
            teacher.collect(model, char_tokenizer(), CONVERSATIONS, tmp_path / name, config, {"test": True})
        monkeypatch.setattr(teacher, "label", real)
        assert 0 < len(teacher.read_index(tmp_path / name)["shards"]) < 4  # it stopped half way
    return model, teacher.collect(model, char_tokenizer(), CONVERSATIONS, tmp_path / name, config, {"test": True})


def test_shards_hold_the_models_features_and_ranks_and_a_rerun_appends_to_the_same_data(tmp_path, monkeypatch):
    model, index = _collect(tmp_path, "straight", 10_000)
    assert len(index["shards"]) >= 2 and sum(s["sequences"] for s in index["shards"]) == 8
    sequences = teacher.load_sequences(tmp_path / "straight")
    assert sorted(s["heldout"] for s in sequences) == [False] * 7 + [True]
    for s in sequences:
        ids = s["tokens"].long()
        seen = []
        handle = model.model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
        handle.remove()
        assert s["features"].shape[0] == len(ids) - 1
        torch.testing.assert_close(s["features"].float(), seen[0][0, :-1], atol=2e-2, rtol=1e-2)  # float16 storage
        for t in range(1, len(ids)):
            expected = int((logits[t - 1] > logits[t - 1, ids[t]]).sum()) if s["draft"][t] else teacher.MAX_RANK
            assert int(s["rank"][t]) == min(expected, teacher.MAX_RANK), t
        assert s["prompt_len"] == int(s["draft"].nonzero()[0, 0])

    _, resumed = _collect(tmp_path, "interrupted", 10_000, fail_after=3, monkeypatch=monkeypatch)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in index["shards"]]
    assert teacher.data_hash(resumed) == teacher.data_hash(index)
    with pytest.raises(Exception, match="other options"):
        teacher.ShardWriter(tmp_path / "straight", teacher.TeacherConfig(max_len=7), {})


def test_griffin_mask_trains_a_row_only_where_the_model_would_have_taken_its_path():
    s = {"tokens": torch.arange(8), "draft": torch.tensor([0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool),
         "rank": torch.tensor([255, 255, 0, 9, 0, 1, 0, 0], dtype=torch.uint8), "features": torch.zeros(7, 4)}
    draft, ok = path_tokens([s], [(0, 0)], 5, 2, top_k=4)
    assert ok[0].tolist() == [True, True, True, False, True, True, True, True]  # token 3: rank 9
    # pass 0, row i drafts token i + 2 through token i + 1; pass 1 drafts i + 3 through i + 1, i + 2
    assert path_valid(draft, ok, 0, 5)[0].tolist() == [True, True, False, True, True]
    assert path_valid(draft, ok, 1, 5)[0].tolist() == [True, False, False, True, True]
    draft, ok = path_tokens([s], [(0, 0)], 5, 2, top_k=0)
    assert path_valid(draft, ok, 1, 5)[0].tolist() == [True] * 5
    draft, ok = path_tokens([{k: v for k, v in s.items() if k in ("tokens", "features")}], [(0, 0)], 5, 2, top_k=4)
    assert bool(draft.all() and ok.all())  # the model's own continuations: every row


def test_fused_states_lie_beside_the_same_shards(tmp_path):
    """With fused layers the shards (and the data hash) are the same bytes; the states sit in files of their
    own, row for row with the features; shards without them say so, and the options cannot be mixed."""
    _, plain = _collect(tmp_path, "plain", 10_000)
    model, fused = _collect(tmp_path, "fused", 10_000, fused_layers=(2, 5))
    assert [s["sha256"] for s in fused["shards"]] == [s["sha256"] for s in plain["shards"]]
    assert teacher.fused_hash(plain) is None and len(teacher.fused_hash(fused)) == 64
    for s in teacher.load_sequences(tmp_path / "fused", fused=True):
        with torch.no_grad():
            states = model(s["tokens"].long()[None], output_hidden_states=True).hidden_states
        expected = torch.cat([states[2][0, :-1], states[5][0, :-1]], dim=-1)
        torch.testing.assert_close(s["fused"].float(), expected, atol=2e-2, rtol=1e-2)  # float16 storage
    with pytest.raises(Exception, match="without fused hidden states"):
        teacher.load_sequences(tmp_path / "plain", fused=True)
    with pytest.raises(Exception, match="other options"):
        teacher.ShardWriter(tmp_path / "plain", teacher.TeacherConfig(shard_tokens=120, batch_tokens=256, chunk_tokens=100,
                                                                      fused_layers=(2, 5)), {})
    # A run without fusion reads shards that have the states, and goes on writing them.
    writer = teacher.ShardWriter(tmp_path / "fused", teacher.TeacherConfig(shard_tokens=120, batch_tokens=256, chunk_tokens=100), {})
    assert writer.config.fused_layers == (2, 5)
    assert "fused" not in teacher.load_sequences(tmp_path / "fused")[0]


def test_the_replies_tier_continues_first_user_turns_of_conversations_outside_the_held_out_ids(tmp_path, monkeypatch):
    """--source sharegpt-replies: the model's own continuations of ShareGPT's first user turns; held-out
    conversations and prompts too long for a continuation are left out, the order is the seed's, and the
    data record their provenance."""
    from dataclasses import replace

    from splitinfer.drafter import data as drafter_data
    from splitinfer.drafter import train

    source = {"sharegpt": chat.SHAREGPT_SOURCE, "read": {"read": 8, "cut": False}}
    monkeypatch.setattr(chat, "usable_sharegpt", lambda: (CONVERSATIONS, source))
    tok = char_tokenizer()
    config = train.TrainConfig(source="sharegpt-replies", prompts=5, max_len=30, max_new_tokens=8, tokens=40,
                               generate_batch=2)
    prompts, record = train.reply_prompts(tok, config)
    texts = [tok.decode(p) for p in prompts]
    assert len(prompts) == 5 and all(len(p) <= 22 for p in prompts)
    assert set(texts) < {f"u:question {i}: why?<eos>\na:" for i in range(8) if i != 3}  # first turns, not held out
    assert record == source | {"first_turns": 7, "short_enough": 7}
    assert train.reply_prompts(tok, replace(config, seed=1))[0] != prompts  # the seed orders them
    assert train.reply_prompts(tok, replace(config, max_len=28))[1]["short_enough"] == 0
    rest = train.reply_prompts(tok, replace(config, first_prompt=5))[0]  # a second run draws the others
    assert len(rest) == 2 and not set(map(tuple, rest)) & set(map(tuple, prompts))
    with pytest.raises(ConfigError, match="past the 7 usable first turns"):
        train.reply_prompts(tok, replace(config, first_prompt=7))
    with pytest.raises(ValueError, match="sharegpt-replies only"):
        train.TrainConfig(first_prompt=5)
    model = tiny_model("llama", seed=5)
    data = drafter_data.collect_data(model, tok, config, tmp_path, prompts)
    assert data["generated_tokens"] >= config.tokens
    assert data["sequences"]
    for s in data["sequences"]:  # each is one of the prompts, continued
        assert tuple(s["tokens"][: s["prompt_len"]]) in set(map(tuple, prompts)) and len(s["tokens"]) > s["prompt_len"]
