"""The expected tokens a decoding request has left, learnt from the requests that finished."""
from __future__ import annotations

import pytest

from engine.scheduler.output_lengths import OutputLengths


def test_a_request_is_expected_to_run_as_long_as_the_finished_requests_that_ran_longer_than_it():
    lengths = OutputLengths()
    assert lengths.expected_remaining(5, 96) == 91  # nothing finished yet: its cap
    for length in (10, 20, 30, 96, 96):
        lengths.record(length)
    assert lengths.expected_remaining(0, 96) == pytest.approx((10 + 20 + 30 + 96 + 96) / 5)
    assert lengths.expected_remaining(25, 96) == pytest.approx((30 + 96 + 96) / 3 - 25)
    assert lengths.expected_remaining(25, 40) == pytest.approx((30 + 40 + 40) / 3 - 25)  # its own cap
    assert lengths.expected_remaining(50, 400) == pytest.approx(96 - 50)
    assert lengths.expected_remaining(96, 400) == 304  # longer than any: its cap
    assert lengths.expected_remaining(29, 30) == 1  # at least one


def test_only_the_latest_finished_requests_count():
    lengths = OutputLengths(window=3)
    for length in (100, 100, 100, 8, 8, 8):
        lengths.record(length)
    assert lengths.expected_remaining(2, 200) == pytest.approx(6)
    lengths.record(50)
    assert lengths.expected_remaining(2, 200) == pytest.approx((8 + 8 + 50) / 3 - 2)
