"""CUDA-graph bucket selection (the capture itself needs a GPU: bench/gpu_check.sh runs it)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine import cuda_graphs
from kvpilot.daemon.engine.cuda_graphs import bucket_for, capture_sizes


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the cap itself is always a bucket
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(256)
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize(("n", "want"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (17, 24),
                                         (250, 256), (256, 256)])
def test_bucket_is_smallest_that_fits(n: int, want: int) -> None:
    assert bucket_for(n, capture_sizes(256)) == want


def test_bucket_out_of_range() -> None:
    sizes = capture_sizes(32)
    assert bucket_for(33, sizes) is None
    assert bucket_for(0, sizes) is None
    assert bucket_for(5, []) is None


def test_off_on_cpu_and_with_enforce_eager() -> None:
    assert not cuda_graphs.enabled(torch.device("cpu"))
    assert not cuda_graphs.enabled(torch.device("cuda"), enforce_eager=True)
    assert cuda_graphs.enabled(torch.device("cuda"))
