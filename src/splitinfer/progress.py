"""Progress bars for long work (prepare, long prefills, benchmarks, audit training), on stderr only.

    from splitinfer.progress import progress
    for chunk in progress(chunks, desc="prefill", unit="chunk"):
        ...
    with progress(total=n_rows, desc="collect", unit="doc") as bar:
        bar.update(k)

Bars appear only when stderr is a terminal and SPLITINFER_NO_PROGRESS is unset, so logs, pipes, CI and
JSON output stay clean. The helper knows nothing about what it measures.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

NO_PROGRESS_ENV = "SPLITINFER_NO_PROGRESS"


def progress_enabled() -> bool:
    return sys.stderr.isatty() and not os.environ.get(NO_PROGRESS_ENV)


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
             enabled: bool | None = None, **kwargs) -> tqdm:
    """A tqdm bar (iterable or manual `update`), silent unless `enabled` (default: progress_enabled())."""
    disable = not (progress_enabled() if enabled is None else enabled)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True, **kwargs)
