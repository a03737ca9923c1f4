"""Build hook: ``<!-- results: NAME | COMMAND -->`` in a page becomes the benchmark results
file ``benchmarks/results/NAME.md`` (included with its command, machine, date and torch
version, as ``benchmarks/_results.py`` writes it), or, until that file exists, one line
naming the command that writes it. Numbers are never typed into the pages.

What is included is what a reader of the page needs, and nothing of the machine that ran
it: the file's own title goes (the page's heading says what the file compares, and several
files share a title), raw curves go (they stay in the results files), and absolute paths
become names: Python's standard library as "Python stdlib", any other path its last part."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!--\s*results:\s*([\w.-]+)\s*\|\s*(.+?)\s*-->")
STDLIB = re.compile(r"(?:/[\w.+-]+)+/lib/python3\.\d+(?![\w./+-])/?")
MACHINE_PATH = re.compile(
    r"(?<![\w.:/~-])/(?:root|home|tmp|usr|opt|var|work|mnt|srv|private|Users)(?:/[\w.+@-]+)+/?")
TITLE = re.compile(r"\A## [^\n]*\n+")
CURVES = re.compile(r"\n*curves \(step, seconds, val bpb\):\n+```\n.*?```\n?", re.DOTALL)


def clean(text: str) -> str:
    """A results file as a page shows it: no title, no raw curves, no machine paths."""
    text = CURVES.sub("\n", TITLE.sub("", text))
    text = STDLIB.sub("Python stdlib", text)
    return MACHINE_PATH.sub(lambda m: Path(m.group(0).rstrip("/")).name, text)


def _replace(match: re.Match) -> str:
    name, command = match.group(1), match.group(2)
    path = RESULTS / f"{name}.md"
    if path.exists():
        return clean(path.read_text())
    return (f"*No results file yet: `{command}` writes `benchmarks/results/{name}.md`, "
            "which this page then includes.*")


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(_replace, markdown)
