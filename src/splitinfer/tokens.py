"""Reading bearer-token files, shared by the client (its one token) and the servers (the tokens they accept).

Only the file format lives here: one token per line, blank lines and '#' comments ignored. What a token
is checked against, and how it travels, belongs to `local/auth.py` and `cloud/security.py`.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError


def read_token_file(path: str | Path) -> list[str]:
    """Tokens in a file, one per line; blank lines and lines starting with '#' are ignored."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}.") from exc
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ConfigError(f"the token file {path} holds no token; put one token per line.")
    return tokens
