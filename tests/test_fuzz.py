"""tools/fuzz.py for a fixed seed and a few cases: random chains of ops built through the Graph
API against PyTorch in float64, forward and every gradient. A mismatch, a crash, a validation
message, or a graph PyTorch refuses and vkml accepts fails it, with the shrunk reproducer."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fuzz  # noqa: E402

SEED, CASES = 20261203, 24


def test_random_op_chains_match_torch(device):
    results = fuzz.fuzz(range(SEED, SEED + CASES), device, log=None)
    failed = [fuzz.report(case, result) for case, result in results if result.failed]
    assert not failed, "\n\n".join(failed)
    # the cases ran through vkml rather than being refused
    assert sum(result.kind == "ok" for _, result in results) >= CASES // 2
