"""`splitinfer api`'s and `splitinfer chat`'s typed defaults beyond the client's (local/config.py): the one place
they are written, read by the commands' options (api/commands.py) and by the library's own signatures
(api/engine.py's Engine, api/server.py's ApiServer), so the Python API and the CLI default alike.

It knows nothing about HTTP, models or the client.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApiOptions:
    """The defaults of `splitinfer api` and `splitinfer chat` beyond the client's own (ClientConfig)."""

    port: int = 8000  # the API's HTTP port
    max_concurrent: int = 4  # requests generating at once; more wait
    max_queued: int = 60  # requests waiting beyond max_concurrent; more get 429
    max_new_tokens: int = 256  # a reply's token limit: max_tokens when a request gives none, and chat's


API_DEFAULTS = ApiOptions()
