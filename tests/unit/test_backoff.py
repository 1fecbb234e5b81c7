"""The one backoff (ipmasq.backoff): client-go's reflector steps (0.8 s doubling to 30 s), fully jittered below the
step, reset by a success; the randomness injected so every draw is checked."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.backoff import Backoff

# client-go's reflector (k8s.io/client-go/tools/cache/reflector.go): defaultBackoffInit 800 ms, defaultBackoffMax 30 s,
# defaultBackoffFactor 2.0; its wait.Backoff doubles the step and holds it at the cap from then on.
CLIENT_GO_STEPS = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0, 30.0]


class Draws:
    """An injected uniform(a, b): records each range asked for and answers a chosen point of it."""

    def __init__(self, at: float) -> None:
        self.at = at  # 0.0: the range's low end, 1.0: its high end
        self.asked: list[tuple[float, float]] = []

    def __call__(self, low: float, high: float) -> float:
        self.asked.append((low, high))
        return low + (high - low) * self.at


def test_the_defaults_are_client_gos_steps_from_0_8_s_doubling_to_a_30_s_cap() -> None:
    backoff = Backoff(jitter=0.0)
    assert [backoff.next() for _ in CLIENT_GO_STEPS] == pytest.approx(CLIENT_GO_STEPS)
    assert backoff.failures == len(CLIENT_GO_STEPS)
    assert backoff.peek() == 30.0


def test_peek_is_the_next_step_before_jitter_and_does_not_advance() -> None:
    backoff = Backoff(uniform=Draws(0.0))
    assert backoff.peek() == backoff.peek() == 0.8
    backoff.next()
    assert backoff.peek() == pytest.approx(1.6)
    assert backoff.failures == 1


def test_each_wait_is_drawn_from_below_its_step_so_the_longest_is_the_cap() -> None:
    draws = Draws(1.0)
    backoff = Backoff(uniform=draws)  # jitter 1.0 by default: fully jittered, [0, step]
    waits = [backoff.next() for _ in CLIENT_GO_STEPS]
    assert draws.asked == [(0.0, pytest.approx(step)) for step in CLIENT_GO_STEPS]
    assert waits == pytest.approx(CLIENT_GO_STEPS)
    half = Draws(0.0)
    backoff = Backoff(jitter=0.25, uniform=half)
    assert [backoff.next() for _ in range(3)] == pytest.approx([0.6, 1.2, 2.4])
    assert half.asked == [(pytest.approx(0.6), pytest.approx(0.8)), (pytest.approx(1.2), pytest.approx(1.6)),
                          (pytest.approx(2.4), pytest.approx(3.2))]


def test_without_jitter_nothing_is_drawn() -> None:
    def never(low: float, high: float) -> float:
        raise AssertionError("drew a random number with jitter 0")

    backoff = Backoff(1.0, 4.0, jitter=0.0, uniform=never)
    assert [backoff.next() for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]


def test_random_uniform_is_looked_up_at_each_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    backoff = Backoff()
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    assert backoff.next() == pytest.approx(0.8)
    monkeypatch.setattr(random, "uniform", lambda low, high: low)
    assert backoff.next() == 0.0


def test_a_success_resets_the_step_and_the_count() -> None:
    backoff = Backoff(jitter=0.0)
    for _ in range(10):
        backoff.next()
    backoff.reset()
    assert (backoff.peek(), backoff.failures) == (0.8, 0)
    assert backoff.next() == 0.8
    backoff.reset()
    backoff.reset()  # twice is once
    assert backoff.next() == 0.8


def test_a_factor_of_one_waits_the_same_and_a_cap_equal_to_the_first_step_never_grows() -> None:
    assert [Backoff(2.0, 5.0, factor=1.0, jitter=0.0).next() for _ in range(3)] == [2.0, 2.0, 2.0]
    same = Backoff(5.0, 5.0, jitter=0.0)
    assert [same.next() for _ in range(3)] == [5.0, 5.0, 5.0]


def test_a_backoff_that_failed_for_a_year_still_waits_the_cap() -> None:
    backoff = Backoff(jitter=0.0)
    for _ in range(100_000):
        wait = backoff.next()
    assert wait == 30.0 and backoff.peek() == 30.0 and backoff.failures == 100_000


@pytest.mark.parametrize("kwargs", [
    {"initial": 0.0}, {"initial": -1.0}, {"initial": 2.0, "cap": 1.0}, {"factor": 0.5}, {"jitter": -0.1},
    {"jitter": 1.5}, {"initial": math.nan}, {"cap": math.nan}, {"cap": math.inf}, {"factor": math.nan},
    {"factor": math.inf}, {"jitter": math.nan}, {"initial": math.inf, "cap": math.inf},
])
def test_parameters_that_would_wait_nothing_forever_or_nan_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**kwargs)


@settings(max_examples=200, deadline=None)
@given(initial=st.floats(0.001, 10.0), extra=st.floats(0.0, 100.0), factor=st.floats(1.0, 4.0),
       jitter=st.floats(0.0, 1.0), at=st.floats(0.0, 1.0),
       ops=st.lists(st.sampled_from(["fail", "fail", "fail", "succeed"]), max_size=60))
def test_every_wait_lies_in_its_step_and_never_past_the_cap(initial: float, extra: float, factor: float,
                                                            jitter: float, at: float, ops: list[str]) -> None:
    cap = initial + extra
    backoff = Backoff(initial, cap, factor=factor, jitter=jitter, uniform=Draws(at))
    step = initial  # a model of the step: what the wait of the next failure is drawn below
    for op in ops:
        if op == "succeed":
            backoff.reset()
            step = initial
            continue
        assert backoff.peek() == pytest.approx(step)
        wait = backoff.next()
        assert step * (1.0 - jitter) - 1e-9 <= wait <= step + 1e-9
        assert 0.0 <= wait <= cap + 1e-9
        step = min(step * factor, cap)
