"""The SGLang adapter's generation rate from streamed arrivals."""

import pytest

from dynarl.workers.sglang.arrival_rate import ArrivalRate


def test_a_lone_request_streaming_a_token_per_step_reads_one_token_per_step() -> None:
    rate = ArrivalRate(window_s=5.0)
    rate.arrived(10.00, 1)
    assert rate.rate(10.00) == 0.0  # one arrival: no interval yet
    rate.arrived(10.03, 1)
    # The first chunk's token was generated before the window began: 1 token in 30 ms.
    assert rate.rate(10.03) == pytest.approx(1 / 0.03)
    for k in range(2, 100):
        rate.arrived(10.0 + 0.03 * k, 1)
    assert rate.rate(10.0 + 0.03 * 99) == pytest.approx(1 / 0.03)


def test_many_requests_chunks_add_up_and_old_arrivals_leave_the_window() -> None:
    rate = ArrivalRate(window_s=1.0)
    for step in range(100):  # 4 requests, a 2-token chunk each every 20 ms
        for _ in range(4):
            rate.arrived(0.02 * step, 2)
    assert rate.rate(0.02 * 99) == pytest.approx(8 / 0.02, rel=0.02)
    # Nothing for a while: the window empties and the rate falls to 0.
    assert rate.rate(10.0) == 0.0
