"""Build hook: ``<!-- results: NAME | COMMAND -->`` in a page becomes the benchmark results
file ``benchmarks/results/NAME.md`` (included with its command, machine, date and torch
version, as ``benchmarks/_results.py`` writes it), or, until that file exists, one line
naming the command that writes it. Numbers are never typed into the pages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!--\s*results:\s*([\w.-]+)\s*\|\s*(.+?)\s*-->")


def _replace(match: re.Match) -> str:
    name, command = match.group(1), match.group(2)
    if (RESULTS / f"{name}.md").exists():
        return f'--8<-- "benchmarks/results/{name}.md"'
    return (f"*No results file yet: `{command}` writes `benchmarks/results/{name}.md`, "
            "which this page then includes.*")


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(_replace, markdown)
