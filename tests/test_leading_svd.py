"""The randomized truncated SVD behind dense init of large layers loses nothing measurable."""

import math

import torch

from comera_compile.formats._svd import chain_svd, leading_svd


def _known_spectrum(rows, cols, values):
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), dtype=torch.float64))
    return (u * values) @ v.T


def test_leading_svd_matches_the_optimal_truncation_error():
    # a slowly decaying spectrum, the hard case for a randomized range finder
    values = 1 / torch.arange(1, 601, dtype=torch.float64).sqrt()
    matrix = _known_spectrum(600, 700, values).float()
    rank = 150
    u, s, vh = leading_svd(matrix, rank)
    assert s.numel() < 600  # the randomized path, not the full decomposition
    approx = (u[:, :rank] * s[:rank]) @ vh[:rank]
    got = float(torch.linalg.matrix_norm(matrix - approx))
    best = math.sqrt(float((values[rank:] ** 2).sum()))  # Eckart-Young
    assert best < got < 1.01 * best
    torch.testing.assert_close(s[:10].double(), values[:10], rtol=1e-3, atol=0)


def test_chain_svd_randomized_bond_error_is_exact_and_near_the_full_svd():
    values = 0.995 ** torch.arange(640, dtype=torch.float64)
    tensor = _known_spectrum(640, 640, values).float().reshape(640, 20, 32)
    cores, err = chain_svd(tensor, [640, 20, 32], max_rank=[100, 20])
    rebuilt = torch.einsum("aib,bjc,ckd->ijk", *cores)
    measured = float(torch.linalg.vector_norm(tensor - rebuilt))
    assert abs(err - measured) < 1e-3 * measured  # the reported error is the real one
    _, full_err = chain_svd(tensor, [640, 20, 32], max_rank=[100, 20], tolerance=0.0)
    assert full_err < measured < 1.01 * full_err  # tolerance= takes the full SVD path
