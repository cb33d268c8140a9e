"""Chat prompts for drafter training, built from text every Debian/Python machine has offline.

Three kinds: excerpts of Python standard-library docstrings (read from imported modules' __doc__), of
/usr/share/common-licenses and /usr/share/doc text files, each wrapped in an instruction ("Summarise",
"Explain", ...), and synthetic instructions from templates (stories, conversation, code, explanations).
The order is fixed for a seed, and no prompt may equal or contain a benchmark prompt
(`check_no_overlap`), so the head is never trained on what it is measured on. Corpus version 2 also
leaves out every template fill on the topic of a benchmark or held-out prompt (`on_topic`: version 1 had
"a lighthouse keeper" and "why the sky is blue", which the benchmark's prompts ask about). Nothing here
runs a model.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import random
import re
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

STDLIB_MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime "
    "decimal difflib email enum fractions functools glob gzip hashlib heapq hmac html http inspect io ipaddress "
    "itertools json logging math mimetypes operator os pathlib pickle pprint queue random re sched secrets "
    "shelve shlex shutil socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading "
    "time timeit tokenize traceback types typing unittest urllib uuid warnings weakref zipfile zlib"
).split()

TEXT_INSTRUCTIONS = (
    "Summarise the following text in a few sentences.\n\n{text}",
    "Explain what this means in plain words.\n\n{text}",
    "Read this and list the main points.\n\n{text}",
    "{text}\n\nWhat is this text about?",
    "Rewrite the following more simply.\n\n{text}",
)

TOPICS = (
    "a lighthouse keeper", "a lost cat", "the first snow of winter", "a robot learning to paint", "a dragon who "
    "is afraid of fire", "two friends on a long train ride", "a city under the sea", "an old clock", "a garden "
    "at night", "a baker who wakes up early", "a mountain village", "a message in a bottle", "the last day of "
    "summer", "a shy astronaut", "a library that never closes", "a river that changes course", "a fox and a crow",
    "a girl who collects stones", "a ship in a storm", "an old man and his dog", "a kite that flies away", "a "
    "forgotten toy", "a quiet forest", "a rainy afternoon in the city", "a boy who talks to trees", "a tiny "
    "island", "a broken bicycle", "a wizard who lost his hat", "a bear who cannot sleep", "a market at dawn",
)
SUBJECTS = (
    "photosynthesis", "how vaccines work", "compound interest", "the water cycle", "why the sky is blue",
    "how a refrigerator works", "the difference between weather and climate", "what inflation is", "how "
    "batteries store energy", "the rules of chess", "how bees make honey", "what a database index is",
    "how airplanes stay in the air", "the causes of tides", "how to read a map", "what recursion is",
    "how the heart pumps blood", "why leaves change colour", "how a bicycle stays upright", "what gravity is",
    "how rainbows form", "how the internet sends messages", "what a budget is", "how plants grow from seeds",
    "why we sleep", "how volcanoes erupt", "what electricity is", "how to take good notes", "what a habit is",
)
CHATS = (
    "Hi! How are you today?", "I feel a bit tired this week. Any advice?", "What should I cook for dinner "
    "tonight?", "Can you recommend a good hobby for the weekend?", "I'm nervous about a job interview tomorrow.",
    "What do you like to talk about?", "Tell me something interesting.", "How can I get better at waking up "
    "early?", "My friend forgot my birthday. What should I do?", "What's a fun thing to do on a rainy day?",
    "Can you help me plan a small party?", "I want to start running. Where do I begin?",
    "I can't decide what book to read next.", "How do I make new friends in a new city?", "What is a good "
    "way to relax after work?", "I keep procrastinating. How do I stop?", "What's your favourite season and "
    "why?", "How do I stay motivated when learning something hard?", "Any tips for a long flight?", "I had a "
    "great day today!", "What should I name my new puppy?", "How can I save a little money each month?",
    "I'm bored. Suggest something to do.", "How do I say no politely?", "What makes a good teacher?",
)
# Appended to synthetic instructions so one subject yields many different replies.
STYLES = (
    "", "", " Keep it short.", " Use simple words.", " Answer in a friendly tone.", " Use a numbered list.",
    " Write two paragraphs.", " Make it a little funny.", " Be clear and concise.", " Add an example.",
)
TASKS = (
    "reverses a string", "counts the vowels in a sentence", "checks whether a number is prime", "merges two "
    "sorted lists", "removes duplicates from a list while keeping order", "computes the factorial of n",
    "parses a date in YYYY-MM-DD format", "finds the longest word in a text", "converts Celsius to Fahrenheit",
    "flattens a nested list", "reads a CSV file and sums a column", "validates an email address",
)
SYNTHETIC = (
    ("Write a short story about {x}.", TOPICS), ("Write a poem about {x}.", TOPICS),
    ("Describe {x} in a few vivid sentences.", TOPICS), ("Explain {x} to a ten-year-old.", SUBJECTS),
    ("Explain {x}.", SUBJECTS), ("Give three facts about {x}.", SUBJECTS), ("{x}", CHATS),
    ("Write a Python function that {x}.", TASKS), ("Write a JavaScript function that {x}.", TASKS),
    ("Write a Python function that {x}, with a docstring and a test.", TASKS),
    ("Tell me a bedtime story about {x}.", TOPICS), ("Write a letter from {x}.", TOPICS),
    ("What can you tell me about {x}?", SUBJECTS), ("Why is {x} important?", SUBJECTS),
    ("Write a dialogue between two people about {x}.", SUBJECTS), ("Write a haiku about {x}.", TOPICS),
)


CORPUS_VERSIONS = (1, 2)  # 1: every fill (the data of heads shipped before); 2: fills on an evaluated topic left out
# Words too common to name a topic: a fill and a prompt sharing only these are not on the same subject.
COMMON_WORDS = frozenset(
    "about add after all also and any are been being but can could did does each every for from get give had has "
    "have her here him his how into its just keep like list make may more most much must not one only other our "
    "out over said say should show some tell than that the their them then there these they this those three two "
    "use very was were what when where which while who why will with would write explain describe you your".split()
)


def topic_words(text: str) -> set[str]:
    """Lower-case words of three letters or more that are not COMMON_WORDS, with a plural or -ing cut."""
    words = set()
    for word in re.findall(r"[a-z]+", text.lower()):
        if len(word) < 3 or word in COMMON_WORDS:
            continue
        for suffix in ("ing", "es", "s"):
            if word.endswith(suffix) and len(word) - len(suffix) >= 3:
                word = word[: -len(suffix)]
                break
        words.add(word)
    return words


def on_topic(fill: str, prompt: str) -> bool:
    """Whether a template fill is about what `prompt` asks: two topic words shared, or the fill's only one."""
    fill_words = topic_words(fill)
    shared = fill_words & topic_words(prompt)
    return len(shared) >= 2 or (len(shared) == 1 and len(fill_words) == 1)


def _fills(fills: tuple[str, ...], corpus: int) -> tuple[str, ...]:
    if corpus == 1:
        return fills
    evaluated = evaluation_prompts()
    return tuple(fill for fill in fills if not any(on_topic(fill, prompt) for prompt in evaluated))


def _excerpts(text: str, rng: random.Random, size: int = 450, count: int = 2) -> list[str]:
    text = "\n".join(line.rstrip() for line in text.strip().splitlines())
    if len(text) < 80:
        return []
    starts = sorted({rng.randrange(max(1, len(text) - size)) for _ in range(count)})
    return [text[s : s + size].strip() for s in starts]


def stdlib_texts(rng: random.Random) -> list[str]:
    texts, seen = [], set()
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        members = [getattr(module, attr) for attr in sorted(dir(module))[:40] if not attr.startswith("_")]
        docs = [module.__doc__] + [m.__doc__ for m in members if inspect.isroutine(m) or inspect.isclass(m)]
        for doc in docs:
            if isinstance(doc, str) and len(doc) > 200 and doc not in seen:
                seen.add(doc)
                texts += _excerpts(doc, rng, count=1)
    return texts


def system_texts(rng: random.Random, limit: int = 1500) -> list[str]:
    """Excerpts of license texts and package documentation under /usr/share (plain or gzip)."""
    paths = sorted(Path("/usr/share/common-licenses").glob("*")) + sorted(Path("/usr/share/doc").glob("*/*"))
    texts = []
    for path in paths:
        if len(texts) >= limit or not path.is_file() or path.name.startswith("copyright"):
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            texts += _excerpts(raw[:200_000].decode("utf-8"), rng, count=1)
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
    return texts


def benchmark_prompts(name: str = "prompts.jsonl") -> list[str]:
    lines = resources.files("splitinfer.data").joinpath(name).read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def evaluation_prompts() -> list[str]:
    """The packaged benchmark and held-out prompts: what the drafter is measured on."""
    return benchmark_prompts() + benchmark_prompts("heldout.jsonl")


def check_no_overlap(prompts: list[str], benchmark: list[str]) -> None:
    for prompt in prompts:
        for bench in benchmark:
            if bench.strip() and (bench.strip() in prompt or prompt.strip() == bench.strip()):
                raise ConfigError(f"a training prompt contains the benchmark prompt {bench[:60]!r}; training "
                                  "data must not include benchmark prompts. Remove it from the corpus.")


def build_prompts(count: int, seed: int, corpus: int = CORPUS_VERSIONS[-1]) -> list[str]:
    """`count` instructions, half from offline text, half synthetic, where there is enough text, shuffled for
    `seed`, from corpus version `corpus` (CORPUS_VERSIONS)."""
    if corpus not in CORPUS_VERSIONS:
        raise ConfigError(f"corpus version {corpus} does not exist; choose among {', '.join(map(str, CORPUS_VERSIONS))}.")
    rng = random.Random(seed)
    texts = stdlib_texts(rng) + system_texts(rng)
    rng.shuffle(texts)
    from_text = [rng.choice(TEXT_INSTRUCTIONS).format(text=t) for t in texts[: count // 2]]
    templates = [(template, _fills(fills, corpus)) for template, fills in SYNTHETIC]
    synthetic = [template.format(x=rng.choice(fill)) + rng.choice(STYLES) for template, fill in
                 (rng.choice(templates) for _ in range(count - len(from_text)))]
    prompts = from_text + synthetic
    rng.shuffle(prompts)
    check_no_overlap(prompts, evaluation_prompts())
    return prompts
