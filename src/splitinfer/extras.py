"""Optional dependencies: which extra a command needs, checked before the command does any work.

A plain `pip install splitinfer` runs the split itself (prepare from a HF directory, serve, generate,
chat); commands beyond that need an extra (pyproject.toml's optional-dependencies). Each such command
calls `require_extra` first, so a missing package reads as one line that names the extra to install,
never as an ImportError from deep inside. This module imports nothing it checks for.
"""

from __future__ import annotations

import importlib.util

from .errors import ConfigError


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package counts as missing
        return False


def require_extra(extra: str, modules: tuple[str, ...], what: str) -> None:
    """Raise ConfigError unless every module of `extra` is importable; `what` names the command or use."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(
            f"{what} needs the {extra} extra ({', '.join(missing)} {verb} not installed): "
            f"pip install 'splitinfer[{extra}]'"
        )


# The modules each extra provides, as imported by the code that needs them.
API = ("starlette", "uvicorn")
AUDIT = ("scipy", "matplotlib")
BENCH = ("matplotlib",)
GGUF = ("gguf", "accelerate")
GPU = ("accelerate",)
RAY = ("ray",)


def is_gguf_source(model: str | None) -> bool:
    """Whether `prepare --model` (None: the embedded default) reads a GGUF file."""
    return model is None or str(model).endswith(".gguf")
