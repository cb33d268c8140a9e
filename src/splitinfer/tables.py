"""Markdown tables: the one renderer every report (bench/, privacy/) writes its tables with."""

from __future__ import annotations


def table(header: list[str], rows: list[list], align: str | None = None) -> list[str]:
    """A Markdown table as lines: `header`, then one line per row (cells through str). `align` is the
    separator line; by default the first column is left-aligned and the rest right-aligned (numbers)."""
    align = align or "|---" + "|---:" * (len(header) - 1) + "|"
    return ["| " + " | ".join(header) + " |", align, *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def left_table(header: list[str], rows: list[list]) -> list[str]:
    """`table` with every column left-aligned (the audit's and the batching benchmark's tables)."""
    return table(header, rows, "|---" * len(header) + "|")
