"""The draft head chained on its own predictions, as it drafts, for every position of a window at once.

At run time the head's depth-1 node reads a true feature, and a depth-(e+1) node reads the feature the
head itself predicted at depth e (decoding/headsource.py), attending to the true pairs before it and to
its own ancestors. `unroll` reproduces that for all n rows of a window in `depth` passes (EAGLE-3's
"training-time test"): pass e feeds row i the pair (h_e[i], x[i+e+1]) at position i+e, with h_0 the true
features, and lets it attend to the true pairs' keys at rows <= i and to row i's own keys of passes
1..e. Training on every pass keeps depth 2+ accurate, and the same passes measure teacher-forced accuracy
by depth (`accuracy`) without running a tree.

Window layout (what `window_tensors` builds): feats [B, n + depth, d] true features f_start...; tokens
[B, n + depth + 1] the tokens x_start...; rows [B] how many feature rows of each window exist; fused
[B, n + depth, F d] the fused head's true hidden states at the same rows (None without). Pass e's targets
are the feature f[i+e+1] and the token x[i+e+2]; a row counts where f[i+e+1] exists. Only pass 0 reads
`fused`: deeper nodes have no true states, as at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.drafthead import DraftHead, HeadCache


@dataclass
class Pass:
    """One depth of an unrolled window: predicted features [B, n, d], valid rows [B, n] (read them out with
    head.logits, on the valid rows only where the padding is worth skipping)."""

    predicted: torch.Tensor
    valid: torch.Tensor


def pass_mask(n: int, e: int, device=None) -> torch.Tensor:
    """[n, (e + 1) n] bool: row i attends to the true pairs' keys j <= i and to its own keys of passes 1..e."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * e, dim=1)


def unroll(head: DraftHead, feats: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, depth: int,
           noise: torch.Tensor | None = None, fused: torch.Tensor | None = None) -> list[Pass]:
    """feats [B, n + depth, d], tokens [B, n + depth + 1], rows [B] -> `depth` passes over n rows each.
    `noise` [B, n, d] is added to the true input features of pass 0 (training only); `fused` [B, n + depth,
    F d] (a fused head's) goes with them."""
    b, total, _ = feats.shape
    n = total - depth
    assert tokens.shape == (b, total + 1) and n > 0, (feats.shape, tokens.shape, depth)
    index = torch.arange(n, device=feats.device)
    h = feats[:, :n] if noise is None else feats[:, :n] + noise
    cache, passes = HeadCache(), []
    for e in range(depth):
        extra = fused[:, :n] if fused is not None and e == 0 else None
        predicted, keys, values = head(h, tokens[:, e + 1 : e + 1 + n], index + e, pass_mask(n, e, feats.device), cache,
                                       extra)
        cache.extend(keys, values)
        valid = index[None, :] + e + 1 < rows[:, None]
        passes.append(Pass(predicted, valid))
        h = predicted
    return passes


def window_tensors(sequences: list[dict], picks: list[tuple[int, int]], n: int, depth: int, device: str = "cpu"):
    """Padded (feats, tokens, rows, fused) for windows (sequence index, start row) of n rows, `depth`
    passes; fused is None unless the sequences hold "fused" states."""
    d = sequences[0]["features"].shape[1]
    has_fused = "fused" in sequences[0]
    fused = torch.zeros(len(picks), n + depth, sequences[0]["fused"].shape[1]) if has_fused else None
    feats = torch.zeros(len(picks), n + depth, d)
    tokens = torch.zeros(len(picks), n + depth + 1, dtype=torch.long)
    rows = torch.zeros(len(picks), dtype=torch.long)
    for k, (i, start) in enumerate(picks):
        f, x = sequences[i]["features"], sequences[i]["tokens"]
        m = min(n + depth, f.shape[0] - start)
        feats[k, :m] = f[start : start + m].float()
        if fused is not None:
            fused[k, :m] = sequences[i]["fused"][start : start + m].float()
        piece = torch.as_tensor(x[start : start + n + depth + 1], dtype=torch.long)
        tokens[k, : len(piece)] = piece
        rows[k] = m
    return feats.to(device), tokens.to(device), rows.to(device), None if fused is None else fused.to(device)


def path_tokens(sequences: list[dict], picks: list[tuple[int, int]], n: int, depth: int, top_k: int) -> tuple:
    """Which tokens of each window may be drafted and which the model would have taken, [B, n + depth + 1]
    bool each: (draft: the token is assistant text, ok: not a drafted token, or one within the model's
    `top_k` at its row). Sequences without "draft"/"rank" (the model's own continuations) are all True;
    top_k 0 counts every token as taken."""
    draft = torch.ones(len(picks), n + depth + 1, dtype=torch.bool)
    ok = torch.ones_like(draft)
    for k, (i, start) in enumerate(picks):
        s = sequences[i]
        if "draft" not in s:
            continue
        d = s["draft"][start : start + n + depth + 1]
        draft[k, : len(d)] = d
        if top_k > 0:
            ok[k, : len(d)] = ~d | (s["rank"][start : start + n + depth + 1] < top_k)
    return draft, ok


def path_valid(draft: torch.Tensor, ok: torch.Tensor, e: int, n: int) -> torch.Tensor:
    """[B, n]: row i of pass e counts where the token it drafts (x[i+e+2]) is assistant text and the model
    would have taken every token on the path to it (x[i+1] .. x[i+e+1]): GRIFFIN's loss mask."""
    valid = draft[:, e + 2 : e + 2 + n].clone()
    for j in range(e + 1):
        valid &= ok[:, j + 1 : j + 1 + n]
    return valid


def target_tokens(tokens: torch.Tensor, e: int, n: int) -> torch.Tensor:
    """[B, n] the token each row's pass-e prediction should draft (x[i+e+2])."""
    return tokens[:, e + 2 : e + 2 + n]


@torch.inference_mode()
def accuracy(head: DraftHead, sequences: list[dict], depth: int = 3, window: int = 128, top_k: int = 4,
             generated_only: bool = True) -> dict:
    """Teacher-forced accuracy by draft depth: the share of rows whose next token is the head's top-1 (and
    among its top-k) when the path to it was drafted right. Rows count where the token to draft is one
    the model generated (not the prompt's) when `generated_only`. -> {"depth": [{"depth", "rows",
    "top1", "topk"}], "top_k"}"""
    hits1, hitsk, counts = [0] * depth, [0] * depth, [0] * depth
    lookup = torch.full((int(head.draft_vocab.max()) + 1,), -1, dtype=torch.long)
    lookup[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    for i, s in enumerate(sequences):
        for start in range(0, max(1, s["features"].shape[0] - 1), window):
            feats, tokens, rows, fused = window_tensors(sequences, [(i, start)], window, depth)
            n = window
            for e, p in enumerate(unroll(head, feats, tokens, rows, depth, fused=fused)):
                target = target_tokens(tokens, e, n)
                keep = p.valid.clone()
                if generated_only:
                    keep &= (torch.arange(n)[None, :] + start + e + 2) >= s["prompt_len"]
                in_vocab = target.clamp(max=len(lookup) - 1)
                draft_id = torch.where(target < len(lookup), lookup[in_vocab], torch.full_like(target, -1))
                top = head.logits(p.predicted).topk(top_k, dim=-1).indices
                counts[e] += int(keep.sum())
                hits1[e] += int((keep & (top[..., 0] == draft_id)).sum())
                hitsk[e] += int((keep & (top == draft_id[..., None]).any(-1)).sum())
    return {"top_k": top_k, "depth": [
        {"depth": e + 1, "rows": counts[e], "top1": round(hits1[e] / max(1, counts[e]), 4),
         "topk": round(hitsk[e] / max(1, counts[e]), 4)} for e in range(depth)]}


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum p_target log p_head ([rows, V] each): distillation from the model's readout."""
    return -(F.softmax(target_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()
