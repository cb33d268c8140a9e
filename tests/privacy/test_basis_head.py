"""A draft head under a secret residual basis: `privatize --basis` re-bases it with the key so it drafts what
it drafted in the public shard, and a head made for another basis is refused (privacy/basis.py,
model/drafthead.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny import prepare_tiny, random_head

from splitinfer.cli import main
from splitinfer.decoding.draft import TokenTrie
from splitinfer.decoding.headsource import HeadDraftConfig, HeadDrafter
from splitinfer.errors import ConfigError
from splitinfer.clients import open_client
from splitinfer.local.config import ClientConfig
from splitinfer.model.commands import install_shipped_drafter
from splitinfer.model.drafthead import DRAFTER_DIR, HEAD_CONFIG, load_head
from splitinfer.model.keyed_norm import KeyedRMSNorm
from splitinfer.model.manifest import PUBLIC_BASIS, basis_identity, model_identity, read_manifest
from splitinfer.model.shards import load_whole_hf
from splitinfer.privacy.basis import BasisConfig, apply_basis, write_basis_shards

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]


def _shards_with_head(tmp_path, family: str = "llama"):
    """Public tiny shards with a random head (saved in float16, as heads ship) installed in the local shard."""
    model, shards = prepare_tiny(tmp_path, family, 2, 2)
    local = open_client(local_only=True, shards=shards).local
    random_head(local, vocab=64).save(shards / "local" / DRAFTER_DIR, extra={"model_fingerprint": model_identity(local.manifest)})
    return model, shards


def _final_features(shards) -> torch.Tensor:
    """[len(PROMPT), d] features the tail hands the head: the stream entering the final norm."""
    model, seen = load_whole_hf(shards), []
    model.model.norm.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0]))
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    return seen[0][0]


def _draft(head, features: torch.Tensor) -> TokenTrie:
    drafter = HeadDrafter(head, HeadDraftConfig(top_k=3, beam=2, max_depth=4, max_nodes=10, min_path_prob=0.0))
    drafter.start(PROMPT[:-1], features[:-1])
    trie = TokenTrie()
    drafter.propose(PROMPT[-1], trie)
    return trie


def _all_logits(head, features: torch.Tensor) -> torch.Tensor:
    """The head's draft logits at every prompt position, teacher-forced: [len(PROMPT) - 1, draft vocab]."""
    n = len(PROMPT) - 1
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    predicted, _, _ = head(features[None, :n], torch.tensor([PROMPT[1:]]), torch.arange(n), allowed)
    return head.logits(predicted[0])


@pytest.mark.parametrize("key", ["linear", "orthogonal"])
def test_privatize_basis_rebases_the_head_so_it_drafts_as_in_the_public_shard(tmp_path, capsys, key):
    _, shards = _shards_with_head(tmp_path)
    out = tmp_path / "keyed"
    args = ["privacy", "privatize", "--shards", str(shards), "--out", str(out), "--basis", "--seed", "9", "--key", key, "--metric-block", "16"]
    assert main(args) == 0
    assert "re-based the draft head with the key" in capsys.readouterr().out
    manifest = read_manifest(out / "local", "local")
    info = json.loads((out / "local" / DRAFTER_DIR / HEAD_CONFIG).read_text())
    assert info["basis"] == basis_identity(manifest) == manifest["residual_basis"]["basis_id"] != PUBLIC_BASIS
    assert info["model_fingerprint"] == model_identity(read_manifest(shards / "local", "local"))
    public, keyed = open_client(local_only=True, shards=shards), open_client(local_only=True, shards=out)
    assert isinstance(keyed.draft_head.input_norm, KeyedRMSNorm) == (key == "linear")
    f_public, f_keyed = _final_features(shards), _final_features(out)
    assert (f_public - f_keyed).abs().max() > 0.1  # the head really reads other coordinates
    expected, got = _draft(public.draft_head, f_public), _draft(keyed.draft_head, f_keyed)
    assert len(expected) == 10 and got.token == expected.token and got.parent == expected.parent
    torch.testing.assert_close(torch.tensor(got.score), torch.tensor(expected.score), rtol=1e-4, atol=1e-6)
    reference = _all_logits(public.draft_head, f_public)
    torch.testing.assert_close(_all_logits(keyed.draft_head, f_keyed), reference, rtol=1e-4, atol=1e-4)
    # The public head over the keyed shard (what loading it unchecked would do) drafts something else.
    local = keyed.local
    unrebased = load_head(shards / "local" / DRAFTER_DIR, local.embed, local.norm, local.lm_head)
    assert (_all_logits(unrebased, f_keyed) - reference).abs().max() > 0.1


def test_a_head_made_for_another_basis_is_refused(tmp_path):
    model, shards = _shards_with_head(tmp_path, "qwen2")  # tied: the keyed config differs from the public one
    outs = []
    for seed in (1, 2):
        keyed, secret, record = apply_basis(model, BasisConfig(seed=seed, key="orthogonal"))
        out, note = write_basis_shards(keyed, secret, shards, tmp_path / f"keyed{seed}", record)
        assert "re-based the draft head" in note
        outs.append(out)
    assert open_client(local_only=True, shards=outs[0]).draft_head is not None  # its own head loads
    heads = {"public": shards / "local" / DRAFTER_DIR, "other key": outs[1] / "local" / DRAFTER_DIR}
    for made_for, head in heads.items():
        target = outs[0] / "local" / DRAFTER_DIR
        shutil.rmtree(target)
        shutil.copytree(head, target)
        with pytest.raises(ConfigError, match=r"privatize --basis.*prepare` again") as refused:
            open_client(local_only=True, shards=outs[0])
        assert ("the public basis" in str(refused.value)) == (made_for == "public")
        assert open_client(local_only=True, shards=outs[0], config=ClientConfig(drafter="off")).draft_head is None  # --drafter off still runs
    shutil.rmtree(shards / "local" / DRAFTER_DIR)
    shutil.copytree(outs[0] / "local" / DRAFTER_DIR, shards / "local" / DRAFTER_DIR)
    with pytest.raises(ConfigError, match="secret basis .* is in the public basis"):
        open_client(local_only=True, shards=shards)


def test_shards_without_a_head_are_keyed_without_one(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    keyed, secret, record = apply_basis(model, BasisConfig(seed=3, key="linear", metric_block=16))
    out, note = write_basis_shards(keyed, secret, shards, tmp_path / "keyed", record)
    assert note.startswith("no draft head") and not (out / "local" / DRAFTER_DIR).exists()


def test_prepare_installs_a_shipped_head_only_for_its_model_and_basis(tmp_path):
    model, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    local = open_client(local_only=True, shards=shards).local
    shipped = tmp_path / "shipped"
    random_head(local, vocab=64).save(shipped / "tiny", extra={"model_fingerprint": model_identity(local.manifest)})
    assert install_shipped_drafter(shards / "local", shipped).startswith("installed the shipped draft head 'tiny'")
    assert open_client(local_only=True, shards=shards).draft_head is not None
    _, other = prepare_tiny(tmp_path, "mistral", 2, 2)
    assert install_shipped_drafter(other / "local", shipped).startswith("no shipped draft head matches this model")
    keyed, secret, record = apply_basis(model, BasisConfig(seed=4, key="orthogonal"))
    out, _ = write_basis_shards(keyed, secret, shards, tmp_path / "keyed", record)
    shutil.rmtree(out / "local" / DRAFTER_DIR)
    note = install_shipped_drafter(out / "local", shipped)
    assert "was not installed" in note and "privatize --basis" in note
    assert not (out / "local" / DRAFTER_DIR).exists()


def test_basis_identity_names_public_keyed_and_unnamed_shards():
    assert basis_identity({"model_id": "m"}) == PUBLIC_BASIS
    assert basis_identity({"residual_basis": {"method": "x", "basis_id": "abc"}}) == "abc"
    unnamed = basis_identity({"residual_basis": {"method": "x"}})
    assert unnamed.startswith("unnamed-") and unnamed != basis_identity({"residual_basis": {"method": "y"}})


def test_a_fused_heads_projection_is_rebased_with_the_rest(tmp_path):
    """A fused head (model/drafthead.py fused_layers) reads hidden states of the keyed stream too: under the
    key, fed the keyed model's own states, it predicts what the public head predicts from the public ones."""
    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    local = open_client(local_only=True, shards=shards).local
    random_head(local, vocab=64, fused_layers=(2, 4)).save(
        shards / "local" / DRAFTER_DIR, extra={"model_fingerprint": model_identity(local.manifest)})
    out = tmp_path / "keyed"
    assert main(["privacy", "privatize", "--shards", str(shards), "--out", str(out), "--basis", "--seed", "9",
                 "--key", "linear", "--metric-block", "16"]) == 0
    logits = []
    for directory in (shards, out):
        model, seen = load_whole_hf(directory), []
        model.model.norm.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0]))
        with torch.no_grad():
            states = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        head = load_head(directory / "local" / DRAFTER_DIR, model.model.embed_tokens, model.model.norm, model.lm_head)
        n = len(PROMPT) - 1
        fused = torch.cat([states[2][:, :n], states[4][:, :n]], dim=-1)
        predicted, _, _ = head(seen[0][:, :n], torch.tensor([PROMPT[1:]]), torch.arange(n),
                               torch.ones(n, n, dtype=torch.bool).tril(), fused=fused)
        logits.append(head.logits(predicted[0]))
    assert (logits[0] - logits[1]).abs().max() < 1e-3 * logits[0].abs().max()
