"""Log-probabilities in OpenAI's two shapes, from (token, logprob, top alternatives) records.

The records come from the trusted side's own logits (decoding/loop.py): the log-softmax of the row that
predicted each token, before temperature, top-p or top-k, as vLLM reports by default. A token's text is
its bytes decoded as UTF-8 (a token that holds part of a character shows U+FFFD; `bytes` holds the exact
bytes), so chat entries carry both, as OpenAI's do.

`TokenRecorder` pairs the records with the text that reaches the client: a token's entry goes out with the
first piece of text sent after it, so the entries of a streamed reply add up to the entries of the same
reply unstreamed, and tokens whose text never went out (an end-of-sequence token, a stop string cut from
the reply) have none.
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Each token id's bytes and text under one tokenizer (None: token ids only, shown as `token_id:N`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        if token in self._cache:
            return self._cache[token]
        tok = self.tokenizer
        if tok is None:
            data = f"token_id:{token}".encode()
        else:
            piece = tok.convert_ids_to_tokens(token)
            byte = _BYTE_PIECE.fullmatch(piece or "")
            decoder = _byte_decoder()
            if byte:
                data = bytes([int(byte.group(1), 16)])
            elif self.byte_level and piece and all(c in decoder for c in piece):
                data = bytes(decoder[c] for c in piece)
            else:
                data = tok.decode([token]).encode()
        self._cache[token] = data
        return data

    def entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """OpenAI's chat form: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        def one(t: int, lp: float) -> dict:
            data = self.bytes_of(t)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(data)}

        return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy completions form; `offset` is where this part's text starts in the reply."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{alt["token"]: alt["logprob"] for alt in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


class TokenRecorder:
    """Entries of generated tokens, handed out with the text that follows them (module doc)."""

    def __init__(self, texts: TokenText, stop_ids: set[int]):
        self.texts, self.stop_ids = texts, stop_ids
        self.pending: list[dict] = []

    def on_token(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        if token not in self.stop_ids:
            self.pending.append(self.texts.entry(token, logprob, top))

    def take(self) -> list[dict]:
        """The entries of the tokens since the last take: call it as a piece of text goes out."""
        taken, self.pending = self.pending, []
        return taken
