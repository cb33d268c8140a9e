"""The offline prompts that warm starts are built from share nothing with the benchmark or held-out prompts."""

from __future__ import annotations

import json
from importlib import resources

from splitinfer.offline import offline_prompts, prompts_hash


def _packaged(name: str) -> list[str]:
    text = resources.files("splitinfer.data").joinpath(name).read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def test_offline_prompts_are_seeded_and_disjoint_from_the_measured_prompts():
    first, again, other = offline_prompts(400, seed=0), offline_prompts(400, seed=0), offline_prompts(400, seed=1)
    assert prompts_hash(first) == prompts_hash(again) != prompts_hash(other)
    measured = _packaged("prompts.jsonl") + _packaged("heldout.jsonl")
    assert len(measured) == 30
    built = [p["prompt"] for p in first + other]
    for prompt in measured:
        # no measured prompt, nor its opening words, appears in what the tables are built from
        opening = " ".join(prompt.split()[:6])
        assert not any(opening in b for b in built), opening


def test_no_offline_template_fill_is_on_the_topic_of_a_measured_prompt():
    from splitinfer.drafter.corpus import evaluation_prompts, on_topic
    from splitinfer.offline import SYNTHETIC

    fills = [fill for _, subjects in SYNTHETIC.values() for fill in subjects]
    assert len(fills) > 40
    assert not [(f, p) for f in fills for p in evaluation_prompts() if on_topic(f, p)]
