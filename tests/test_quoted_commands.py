"""Every command a page quotes exists (issue 63): each `splitinfer ...` in backticks or in a shell block of the
README, docs/ and notes/ parses with the CLI's own parser, and each `scripts/NAME.py` (or .sh) a page quotes is
there, so no stored run's note tells a reader to rerun it with a command that was renamed or deleted.

A quoted command must parse as given: a placeholder such as DIR or OUT is a value like any other. A page may
mention a command without all of it, so before giving up the check fills in what a mention leaves out: the
options the command requires (`splitinfer serve`), a value after a last option (`bench spec --readme`) and a
number an upper-case placeholder stands for (`--replicas N`), each with "1" (or a required argument's first
choice). A sketch (`generate|chat|api`,
`[--key K]`, `...`) must name commands that exist and only options they have. A message the CLI prints
(`splitinfer privacy audit needs ...: pip install ...`) is not a command. tests/test_docs.py runs the README's and
docs/'s shell blocks; this reads every page.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from splitinfer.cli import build_parser
from splitinfer.options import complete

ROOT = Path(__file__).parents[1]
FENCE = re.compile(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", re.S | re.M)
SPAN = re.compile(r"(`+)((?:(?!\n\s*\n).)+?)\1", re.S)  # inline code: within one paragraph
SHELL = ("", "bash", "sh", "shell", "console")
SEPARATORS = (";", "&", "&&", "||", "|")
SCRIPT = re.compile(r"(?<![\w.-])(?:\S*/)?(scripts/[\w.-]+\.(?:py|sh))\b")
FILLER = "1"  # what a mention leaves out, filled in: a number, a path or a name alike
REQUIRED = re.compile(r"the following arguments are required: (.*)")
NO_VALUE = re.compile(r"argument (\S+?)(?:/\S+)?: expected one argument")
FILLED_CHOICE = re.compile(rf"invalid choice: '{FILLER}' \(choose from '([^']+)'")
PLACEHOLDER = re.compile(r"argument \S+: invalid (?:int|float|\w+) value: '([A-Z][A-Z_]*)'")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notes").rglob("*.md"))]


def quoted(text: str) -> list[tuple[int, str]]:
    """(line, code) of each shell block's lines (continuations joined) and of each inline code span elsewhere."""
    found, blanked = [], list(text)
    for match in FENCE.finditer(text):
        first = text.count("\n", 0, match.start()) + 2
        if match.group(1) in SHELL:
            found += [(first + i, code) for i, code in enumerate(match.group(2).replace("\\\n", " ").splitlines())]
        blanked[match.start():match.end()] = [c if c == "\n" else " " for c in match.group(0)]
    rest = "".join(blanked)
    found += [(rest.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in SPAN.finditer(rest)]
    return sorted(found)


def commands(code: str) -> list[list[str]]:
    """The words after `splitinfer` of each command in one piece of code (a shell line may hold several)."""
    try:
        words = shlex.split(re.sub(r"^\s*(?:\$ |ExecStart=)", "", code), comments=True)
    except ValueError:  # an unclosed quote: a fragment of prose
        words = code.split()
    found, current = [], []
    for word in [*words, ";"]:
        if word not in SEPARATORS:
            current.append(word)
            continue
        while current and (re.fullmatch(r"\w+=\S*", current[0]) or current[0] in ("nohup", "env", "exec", "time")):
            current = current[1:]  # VAR=value, nohup ...: the command comes after them
        if current[:2] == ["sudo", "-u"]:
            current = current[3:]
        if current[1:3] == ["-m", "splitinfer"] and "python" in current[0]:
            current = current[2:]
        if current and (current[0] == "splitinfer" or current[0].endswith("/bin/splitinfer")):
            if not any(w.endswith(":") for w in current):  # a message, `splitinfer x: error: ...`
                found.append(current[1:])
        current = []
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return action.choices if action else {}


def sketch_refusal(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """Why a sketch is refused: a command it names that does not exist, or an option the command lacks."""
    names = subcommands(parser)
    if words and not words[0].startswith(("-", "[")) and names:
        wrong = [w for w in words[0].split("|") if w not in names]
        if wrong:
            return f"no command {wrong[0]!r} in `{parser.prog}`"
        return next(filter(None, (sketch_refusal(names[w], words[1:]) for w in words[0].split("|"))), None)
    options = {o for a in complete(parser)._actions for o in a.option_strings}
    flags = [w.strip("[]").split("=")[0] for w in words if w.strip("[]").startswith("-")]
    unknown = [f for f in flags if f not in options]
    return f"`{parser.prog}` has no option {unknown[0]}" if unknown else None


def refusal(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """Why the CLI refuses `splitinfer WORDS` (after filling in what a mention leaves out), or None."""
    if any(w == "..." or "|" in w or w.startswith("[") or w.endswith("]") for w in words):
        return sketch_refusal(parser, [w for w in words if w != "..."])
    for _ in range(8):
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(words)
            return None
        except SystemExit as exc:
            if exc.code == 0:  # --help, --version
                return None
            error = stderr.getvalue().strip().splitlines()[-1]
        if (m := REQUIRED.search(error)) and "COMMAND" in m.group(1):
            return sketch_refusal(parser, words)  # a group named alone (`splitinfer bench`), or with its options
        if m:
            words = [*words, *(x for name in m.group(1).split(", ")
                               for x in ((name.split("/")[0], FILLER) if name.startswith("-") else (FILLER,)))]
        elif (m := NO_VALUE.search(error)) and words[-1] == m.group(1):
            words = [*words, FILLER]
        elif (m := FILLED_CHOICE.search(error)) and FILLER in words:
            at = len(words) - 1 - words[::-1].index(FILLER)
            words = [*words[:at], m.group(1), *words[at + 1:]]
        elif m := PLACEHOLDER.search(error):
            words = [FILLER if w == m.group(1) else w for w in words]
        else:
            return error
    return error


def quoted_commands():
    for page in pages():
        for line, code in quoted(page.read_text()):
            for words in commands(code):
                yield f"{page.relative_to(ROOT)}:{line}", words


def test_every_quoted_command_parses():
    parser = build_parser()
    seen, refused = 0, []
    for where, words in quoted_commands():
        seen += 1
        why = refusal(parser, words)
        if why:
            refused.append(f"{where}: `splitinfer {shlex.join(words)}`: {why}")
    assert seen > 100
    assert not refused, "quoted commands the CLI refuses (quote today's command):\n" + "\n".join(refused)


def test_every_quoted_script_exists():
    missing = [f"{page.relative_to(ROOT)}:{line}: {path}" for page in pages() for line, code in quoted(page.read_text())
               for path in SCRIPT.findall(code) if not (ROOT / path).is_file()]
    assert not missing, "quoted scripts that are not in scripts/:\n" + "\n".join(missing)


@pytest.mark.parametrize("command, refused", [
    ("bench step --shards shards/smollm2 --out DIR", False),
    ("serve", False),  # a mention: --shard is filled in
    ("bench", False),  # a group
    ("bench spec --readme", False),  # an option named, its value left out
    ("serve --tp N ...", False),
    ("serve --ray --replicas N", False),
    ("generate|chat|api --server A --server B ...", False),
    ("privacy privatize --basis [--key linear|orthogonal]", False),
    ("bench-kernels --out docs/bench/kernels", True),  # a command that is gone
    ("bench --shards shards/smollm2 --out docs/bench", True),  # the old sweep's name
    ("bench step --shards s --out o --made-up 3", True),  # an option that never was
    ("serve --made-up", True),
    ("bench sweep --made-up ...", True),
    ("generate|frobnicate --server A", True),
    ("bench frobnicate", True),
    ("privacy audit stray words", True),
])
def test_a_made_up_command_is_refused(command, refused):
    assert (refusal(build_parser(), shlex.split(command)) is not None) == refused


def test_quoted_code_is_found_in_spans_and_shell_blocks():
    text = ("Run `splitinfer serve --shard s`, or `python -m splitinfer wan`\nthen\n\n```bash\nX=1 splitinfer bench "
            "step \\\n  --out DIR && python scripts/x.py\n```\n\n```python\nsplitinfer is on PYTHONPATH\n```\n"
            "`splitinfer privacy audit needs the audit extra (scipy): pip install 'splitinfer[audit]'`\n")
    got = [c for _, code in quoted(text) for c in commands(code)]
    assert sorted(got) == [["bench", "step", "--out", "DIR"], ["serve", "--shard", "s"], ["wan"]]
    assert SCRIPT.findall("python /work/main/scripts/bench_arena.py --out x; bash scripts/gpu_check.sh") == [
        "scripts/bench_arena.py", "scripts/gpu_check.sh"]
