"""Offline corpora for the audit, tokenised into chunks and split into train and test by source document.

Sources, all present on any machine that runs splitinfer, none downloaded:
  stdlib    docstrings of the Python standard library's own .py files, read with `ast` (nothing imported)
  licenses  the licence texts under /usr/share/common-licenses (Debian's base-files), when present

Both are almost certainly in any LLM's pretraining data, which inflates attacks that lean on the model's
prior (A4's candidate pruning, the logit lens); the audit says so next to its numbers.

Canaries are synthetic sentences (made-up names, account numbers, PINs) planted at the start of a share of
the chunks, different ones in train and test; the positions of their tokens are recorded so the audit can
report how much of a secret that was never public is recovered. This module knows nothing about models
beyond a tokenizer's `__call__`.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

LICENSE_DIR = Path("/usr/share/common-licenses")
# Parts of the stdlib that are tests, GUIs or vendored code: their docstrings are sparse or repetitive.
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
_SYLLABLES = ["ka", "lor", "vin", "dra", "mel", "tho", "zu", "quen", "bri", "sal", "or", "nix", "pel", "ram", "ju", "vet"]
_STREETS = ["Lane", "Street", "Road", "Way", "Close"]


@dataclass(frozen=True)
class CorpusConfig:
    sources: tuple[str, ...] = ("stdlib", "licenses")  # which offline sources to read
    max_documents: int = 400  # source documents kept (after a seeded shuffle)
    chunk_tokens: int = 128  # tokens per chunk (one forward pass each)
    max_chunks_per_document: int = 3  # so one long file does not dominate
    min_chunk_tokens: int = 32  # shorter leftovers are dropped
    test_fraction: float = 0.3  # share of source documents held out (split by document, never by position)
    canary_fraction: float = 0.2  # share of chunks that start with a planted canary sentence
    seed: int = 0


@dataclass
class Chunk:
    doc_id: int  # source document index (the unit of the train/test split and of the bootstrap)
    source: str  # e.g. "stdlib:json/__init__.py"
    tokens: list[int]
    canary_len: int = 0  # the first canary_len tokens are a planted canary


@dataclass
class Corpus:
    train: list[Chunk] = field(default_factory=list)
    test: list[Chunk] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # source kind -> documents read

    def describe(self) -> dict:
        def count(chunks):
            return {
                "chunks": len(chunks),
                "documents": len({c.doc_id for c in chunks}),
                "tokens": sum(len(c.tokens) for c in chunks),
                "canary_tokens": sum(c.canary_len for c in chunks),
            }

        return {"sources": self.sources, "train": count(self.train), "test": count(self.test)}


@functools.lru_cache(maxsize=1)  # parsing the whole stdlib takes seconds; the result never changes in a process
def stdlib_documents() -> list[tuple[str, str]]:
    """(name, text) per stdlib module: its module, class and function docstrings joined."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # a few stdlib files are templates or in other encodings; they are not needed
        parts = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) > 40:
                    parts.append(text.strip())
        text = "\n\n".join(dict.fromkeys(parts))  # dedupe, keep order
        if len(text) > 400:
            docs.append((f"stdlib:{path.relative_to(root)}", text))
    return docs


def license_documents() -> list[tuple[str, str]]:
    if not LICENSE_DIR.is_dir():
        return []
    docs = []
    for path in sorted(LICENSE_DIR.iterdir()):
        if path.is_file() and not path.is_symlink():
            docs.append((f"licenses:{path.name}", path.read_text(encoding="utf-8", errors="replace")))
    return docs


def canary_sentence(rng: random.Random) -> str:
    """A made-up personal record: nothing in it exists in any pretraining corpus."""

    def name() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()

    return (
        f"Confidential: {name()} {name()}, account {rng.randint(1000, 9999)}-{rng.randint(1000, 9999)}, "
        f"PIN {rng.randint(1000, 9999)}, lives at {rng.randint(2, 998)} {name()} {rng.choice(_STREETS)}."
    )


def _shuffled_documents(config: CorpusConfig) -> tuple[list[tuple[str, str]], dict[str, int], random.Random]:
    """Every (name, text) of the configured sources in the seeded order the audit draws from, and the
    generator that shuffled them (build_corpus draws its canaries from it, as it always has)."""
    readers = {"stdlib": stdlib_documents, "licenses": license_documents}
    unknown = set(config.sources) - set(readers)
    if unknown:
        raise ConfigError(f"unknown corpus source(s) {sorted(unknown)}; choose from {sorted(readers)}.")
    raw: list[tuple[str, str]] = []
    counts = {}
    for kind in config.sources:
        docs = list(readers[kind]())
        counts[kind] = len(docs)
        raw.extend(docs)
    if not raw:
        raise ConfigError("no offline text found for the audit corpus; check the Python installation.")
    rng = random.Random(config.seed)
    rng.shuffle(raw)
    return raw, counts, rng


def _chunks_of(doc_id: int, name: str, ids: list[int], config: CorpusConfig, max_chunks: int, rng: random.Random, tokenizer) -> list[Chunk]:
    out = []
    for start in range(0, len(ids), config.chunk_tokens):
        if start // config.chunk_tokens >= max_chunks:
            break
        body = ids[start : start + config.chunk_tokens]
        if len(body) < config.min_chunk_tokens:
            break
        chunk = Chunk(doc_id, name, body)
        if rng.random() < config.canary_fraction:
            canary = list(tokenizer(canary_sentence(rng) + "\n", add_special_tokens=False)["input_ids"])
            chunk = Chunk(doc_id, name, (canary + body)[: config.chunk_tokens], canary_len=len(canary))
        out.append(chunk)
    return out


def build_corpus(tokenizer, config: CorpusConfig = CorpusConfig()) -> Corpus:
    raw, counts, rng = _shuffled_documents(config)
    corpus = Corpus(sources=counts)
    raw = raw[: config.max_documents]
    n_test = max(1, round(len(raw) * config.test_fraction))
    for doc_id, (name, text) in enumerate(raw):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        split = corpus.test if doc_id < n_test else corpus.train
        split.extend(_chunks_of(doc_id, name, ids, config, config.max_chunks_per_document, rng, tokenizer))
    if not corpus.train or not corpus.test:
        raise ConfigError("the audit corpus is too small to split into train and test; raise --documents.")
    return corpus


def attacker_text(tokenizer, config: CorpusConfig, n_tokens: int, max_chunks_per_document: int = 8) -> list[Chunk]:
    """The chosen-plaintext attacker's own text (T2): about `n_tokens` tokens in whole chunks.

    Drawn from the documents the audit's corpus does not use (those after its first `max_documents` in
    the same seeded order), so it shares no document with the audit's train or test split. The attacker
    plants its own made-up records at the same rate as the audit's canaries (it can write such text too).
    Returns fewer tokens when the sources run out; the audit records how many it got.
    """
    raw, _, _ = _shuffled_documents(config)
    rng = random.Random(config.seed + 1)
    chunks, total = [], 0
    for doc_id, (name, text) in enumerate(raw[config.max_documents :], start=config.max_documents):
        if total >= n_tokens:
            break
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for chunk in _chunks_of(doc_id, name, ids, config, max_chunks_per_document, rng, tokenizer):
            if total >= n_tokens:
                break
            chunks.append(chunk)
            total += len(chunk.tokens)
    return chunks
