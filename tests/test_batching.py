"""Length-grouped text batches: the same rows, regrouped by length, with less padding."""

import itertools

import torch

from comera_compile.training.batching import length_grouped

PAD = 7


def _batches(lengths_per_batch, width=None):
    """Right-padded dict batches with token ids = 100 * row number + position."""
    out, row = [], 0
    for lengths in lengths_per_batch:
        w = width or max(lengths)
        ids = torch.full((len(lengths), w), PAD)
        mask = torch.zeros(len(lengths), w, dtype=torch.long)
        for j, n in enumerate(lengths):
            ids[j, :n] = 100 * row + torch.arange(n)
            mask[j, :n] = 1
            row += 1
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": torch.arange(row - len(lengths), row)})
    return out


def _rows(batch):
    """Each row's real ids, its mask's length and its per-row label."""
    return {(tuple(ids[m.bool()].tolist()), int(m.sum()), int(label))
            for ids, m, label in zip(batch["input_ids"], batch["attention_mask"],
                                     batch["labels"])}


def test_one_pass_has_every_row_once_with_less_padding():
    torch.manual_seed(0)
    lengths = [torch.randint(1, 60, (8,)).tolist() for _ in range(40)]
    batches = _batches(lengths, width=64)  # padded to a fixed width, as many loaders do
    grouped = length_grouped(batches)
    one_pass = list(itertools.islice(grouped, len(batches)))
    before = set().union(*map(_rows, batches))
    after = set().union(*map(_rows, one_pass))
    assert after == before and sum(len(b["labels"]) for b in one_pass) == 320
    cells = lambda bs: sum(b["attention_mask"].numel() for b in bs)  # noqa: E731
    real = sum(sum(x) for x in lengths)
    assert real / cells(one_pass) > 0.85 > 0.6 > real / cells(batches)
    for batch in one_pass:  # right padded with the batches' own pad id, no column all padding
        mask = batch["attention_mask"].bool()
        assert bool(mask[:, -1].any()) and bool((batch["input_ids"][~mask] == PAD).all())
    second = list(itertools.islice(grouped, len(batches)))  # the next pass: a new grouping
    assert set().union(*map(_rows, second)) == before
    assert [b["labels"].tolist() for b in second] != [b["labels"].tolist() for b in one_pass]


def test_rows_from_narrow_batches_are_padded_out():
    batches = _batches([[2, 3], [9, 1]])  # widths 3 and 9
    one_pass = list(length_grouped(batches, passes=1))
    assert len(one_pass) == 2
    assert set().union(*map(_rows, one_pass)) == set().union(*map(_rows, batches))


def test_what_cannot_be_regrouped_is_left_alone():
    batches = _batches([[3, 2], [4, 4]])
    left = [dict(b) for b in batches]
    left[0]["attention_mask"] = left[0]["attention_mask"].flip(-1)  # left padded
    assert length_grouped(left) is None
    assert length_grouped([torch.randn(4, 8)]) is None  # not a dict
    odd = [dict(b, extra=torch.ones(3)) for b in batches]  # not per row
    assert length_grouped(odd) is None
    assert length_grouped([]) is None
    seq2seq = [dict(b, decoder_input_ids=b["input_ids"].clone()) for b in batches]
    assert length_grouped(seq2seq) is None  # a decoder's columns do not go with the mask's
