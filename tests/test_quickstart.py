"""The README's quickstart is examples/quickstart.py verbatim, and it prints what the README
says it prints; the README's results are the results files' own lines."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_the_readme_quickstart_is_the_example_file():
    example = (ROOT / "examples" / "quickstart.py").read_text()
    assert example in _code_blocks(README, "python")


@pytest.mark.slow
def test_the_quickstart_runs_and_prints_the_shape_the_readme_names():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "30"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    claim = re.search(r"a line of the shape\s+`(.*?)`", README, flags=re.S).group(1)
    pattern = re.escape(" ".join(claim.split())).replace("NN\\.N", r"\d+\.\d")
    pattern = pattern.replace("N,NNN", r"[\d,]+")
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(pattern, last), (pattern, last)
    dense, small = (int(v.replace(",", "")) for v in re.findall(r"[\d,]{4,}", last)[-2:])
    assert small < dense / 5  # a tenth of the parameters, and less after the cuts
    assert "cola" in out and "left dense" in out  # the summary table came first


def test_every_results_table_in_the_readme_is_a_results_file_verbatim():
    results = "\n".join(p.read_text() for p in (ROOT / "benchmarks" / "results").glob("*.md"))
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", README, flags=re.S | re.M)
    blocks = [b for b in fenced if "bpb" in b]
    assert blocks  # the README shows the pretraining table
    for block in blocks:
        assert block in results


def test_every_results_row_in_the_readme_is_a_results_file_line():
    results = "\n".join(p.read_text() for p in (ROOT / "benchmarks" / "results").glob("*.md"))
    section = README[README.index("## Results"):README.index("## Limitations")]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows  # the memory table
    for row in rows:
        assert row in results.splitlines(), row


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 250  # details live in docs/, history in CHANGELOG.md
