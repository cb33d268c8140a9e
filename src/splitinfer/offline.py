"""Prompts built from text every installation has offline, for building drafting state from the model's
own generations: Python standard library docstrings and synthetic instructions from fixed templates.

Never the benchmark prompts (data/prompts.jsonl) nor the held-out prompts the measurements use
(data/heldout.jsonl): the templates and subjects below share no prompt with either, and a test checks it.
The set is a pure function of the seed and of this Python's standard library (whose docstrings change
between Python releases), so its hash goes into the manifest of whatever is built from it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random

STDLIB_MODULES = (
    "argparse", "base64", "bisect", "collections", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "hashlib", "heapq", "html",
    "itertools", "json", "logging", "math", "operator", "pathlib", "pprint", "queue", "random", "re",
    "shutil", "sqlite3", "statistics", "string", "tempfile", "textwrap", "threading", "typing",
    "urllib.parse", "uuid", "zipfile",
)

DOC_TEMPLATES = (
    "Explain what `{name}` from Python's {module} module does, with a short example.\n\n{doc}",
    "Summarize this documentation in two sentences:\n\n{doc}",
    "Write a short Python snippet that uses `{name}` and explain each line.",
    "Rewrite this documentation as a bulleted list of facts:\n\n{doc}",
)

SYNTHETIC = {
    "conversational": (
        ("What should I know before {x}?", "Give me practical advice on {x}.", "How do people usually get better at {x}?"),
        ("adopting a cat", "learning to swim as an adult", "moving to a new city", "starting a vegetable garden",
         "training for a first 10k run", "asking for a raise", "learning a second language", "cooking for a large family",
         "buying a used car", "planning a budget trip", "keeping a journal", "repairing a bicycle"),
    ),
    "creative": (
        ("Tell a short tale about {x}.", "Compose verses about {x}.", "Describe {x} in a few vivid sentences."),
        ("a clockmaker who loses track of time", "a fox living near a railway", "a storm over a fishing village",
         "an astronaut's first night back on Earth", "a library that opens only at midnight", "a forgotten violin",
         "the last day of summer at a lake", "a robot learning to paint", "two rivals stuck in an elevator",
         "a market in the early morning", "a garden on a rooftop", "a letter that arrives fifty years late"),
    ),
    "code": (
        ("Write a Python function that {x}.", "Show how to {x} in Python, with comments.",
         "Write a Python function that {x}, and a few tests for it."),
        ("merges two sorted lists", "counts the words in a text file", "checks whether a string is a palindrome",
         "flattens a nested list", "parses a date in ISO format", "removes duplicate lines from a file",
         "computes the median of a list", "converts Celsius to Fahrenheit", "finds the longest common prefix",
         "groups records by a key", "validates an email address with a regular expression", "reverses a linked list"),
    ),
    "structured": (
        ("Produce a JSON document about {x}.", "Lay out {x} as a Markdown table.", "List {x} as CSV with a header row."),
        ("four musical instruments with their families", "five European capitals and their populations",
         "three programming languages and the year each appeared", "the days of the week in French and Spanish",
         "six chemical elements with symbols and atomic numbers", "a weekly meal plan", "three books and their authors",
         "five mountains and their heights", "the phases of the moon", "four seasons with typical weather"),
    ),
}


def docstring_snippets(modules: tuple[str, ...] = STDLIB_MODULES, max_chars: int = 600) -> list[tuple[str, str, str]]:
    """(module, public name, first paragraphs of its docstring) for every documented public callable."""
    found = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a Python built without one (e.g. no sqlite3): the set says so by its hash
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            text = doc.split("\n\n")[0].strip() if len(doc) > max_chars else doc.strip()
            if len(text) >= 40:
                found.append((module_name, f"{module_name}.{name}", text[:max_chars]))
    return found


def offline_prompts(count: int, seed: int = 0) -> list[dict]:
    """`count` prompts, about half from docstrings and half synthetic, each {"id", "category", "prompt"}."""
    rng = random.Random(seed)
    snippets = docstring_snippets()
    prompts = []
    for i in range(count):
        if i % 2 == 0 and snippets:
            module, name, doc = rng.choice(snippets)
            template = rng.choice(DOC_TEMPLATES)
            prompts.append({"category": "docs", "prompt": template.format(name=name, module=module, doc=doc)})
        else:
            category = rng.choice(sorted(SYNTHETIC))
            templates, subjects = SYNTHETIC[category]
            prompts.append({"category": category, "prompt": rng.choice(templates).format(x=rng.choice(subjects))})
    return [{"id": f"offline-{i}", **p} for i, p in enumerate(prompts)]


def prompts_hash(prompts: list[dict]) -> str:
    """SHA-256 of the prompt set as JSON lines: what a manifest records as its data hash."""
    text = "\n".join(json.dumps(p, sort_keys=True) for p in prompts)
    return hashlib.sha256(text.encode()).hexdigest()
