"""The step's host tensors built from Python lists: what torch.tensor builds, by other means."""
from __future__ import annotations

import pytest
import torch

from engine.batch import host_tensor, padded_rows


@pytest.mark.parametrize("dtype", [torch.int32, torch.long])
def test_host_tensor_holds_the_values_in_the_dtype(dtype):
    values = [0, 7, 2**31 - 1, 3]
    got = host_tensor(values, dtype)
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert host_tensor([], dtype).dtype == dtype and host_tensor([], dtype).numel() == 0


def test_host_tensor_outlives_the_list_it_was_built_from():
    values = list(range(1000))
    got = host_tensor(values)
    del values
    torch.zeros(10_000)  # new allocations do not take its memory
    assert torch.equal(got, torch.arange(1000))


@pytest.mark.parametrize("dtype", [torch.int32, torch.long])
def test_rows_are_padded_to_the_longest(dtype):
    rows = [[5, 6, 7], [1], [9, 8]]
    got = padded_rows(rows, -1, dtype)
    assert got.dtype == dtype
    assert got.tolist() == [[5, 6, 7], [1, -1, -1], [9, 8, -1]]


def test_rows_are_cut_or_padded_to_a_given_width():
    """Rows may hold blocks past the context a step reads (allocated ahead): cut to the width."""
    rows = [[5, 6, 7, 4], [1], [9, 8]]
    assert padded_rows(rows, 0, width=2).tolist() == [[5, 6], [1, 0], [9, 8]]
    assert padded_rows(rows, 3, width=5).tolist() == [[5, 6, 7, 4, 3], [1, 3, 3, 3, 3], [9, 8, 3, 3, 3]]
