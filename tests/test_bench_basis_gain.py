"""bench/bench_basis_gain.py's two expectations are exact: they equal the average over every
(U column, V column, sign) choice a seeded direction can make."""

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_basis_gain.py"


def test_basis_stats_equal_the_average_over_every_direction():
    spec = importlib.util.spec_from_file_location("bench_basis_gain_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gen = torch.Generator().manual_seed(0)
    shapes, r = [(5, 3), (4, 6)], 3
    bases = [
        (torch.randn(m, r, generator=gen).double(), torch.randn(n, r, generator=gen).double())
        for m, n in shapes
    ]
    grads = [torch.randn(m, n, generator=gen).double() for m, n in shapes]
    # Every choice: one (a, b, sign) per matrix, independently; d is the matrices' rank-1 parts
    lengths, descents = [], []
    choices = [(a, b, s) for a in range(r) for b in range(r) for s in (1.0, -1.0)]
    for c0 in choices:
        for c1 in choices:
            picks = zip(bases, (c0, c1), strict=True)
            parts = [s * torch.outer(u[:, a], v[:, b]) for (u, v), (a, b, s) in picks]
            lengths.append(sum(float(p.pow(2).sum()) for p in parts))
            descents.append(sum(float((p * g).sum()) for p, g in zip(parts, grads)) ** 2)
    stats = bench.basis_stats(bases, grads)
    assert abs(stats["direction_sq_length"] - sum(lengths) / len(lengths)) < 1e-9 * max(lengths)
    assert abs(stats["descent_per_lr"] - sum(descents) / len(descents)) < 1e-9 * max(descents)
