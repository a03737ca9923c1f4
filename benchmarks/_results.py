"""Results files: every number a benchmark reports is written here with how it was made.

The README and the docs include these files instead of copying numbers by hand, so a
number always travels with the command that printed it, the machine, the date and the
torch version.
"""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

import torch

from comera_compile.cli.machine import describe_machine

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def provenance() -> str:
    """Markdown lines naming the command, machine, date and torch version of this run."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"- command: `{command}`\n"
        f"- {describe_machine()}\n"
        f"- date: {date}\n"
        f"- torch: {torch.__version__}\n"
    )


def write_results(name: str, title: str, body: str, out_dir: Path | None = None) -> Path:
    """Write ``results/<name>.md``: a title, the run's provenance, then ``body`` (markdown)."""
    directory = Path(out_dir) if out_dir is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.md"
    path.write_text(f"## {title}\n\n{provenance()}\n{body.rstrip()}\n")
    return path
