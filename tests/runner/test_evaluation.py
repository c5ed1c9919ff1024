"""pass@k against its definition, counted over every k-subset of the samples."""

from __future__ import annotations

import itertools
import random

from mtprun.runner.run.evaluation import pass_at_k


def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass() -> None:
    rng = random.Random()
    for _ in range(50):
        n = rng.randint(1, 9)
        passes = [rng.random() < 0.4 for _ in range(n)]
        k = rng.randint(1, n)
        subsets = list(itertools.combinations(passes, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert abs(pass_at_k(n, sum(passes), k) - expected) < 1e-12
