"""The one aligned plain-text table that reports, records and benchmarks print."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]],
               right: Collection[int] = ()) -> str:
    """Header, a dashed rule, then the rows; columns ``right`` (numbers) align right."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[k]) for row in cells) for k in range(len(header))]

    def line(row: Sequence[str]) -> str:
        parts = (
            c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths))
        )
        return "  ".join(parts).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *map(line, cells[1:])])
