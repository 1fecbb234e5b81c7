"""The tests' one wait (tests/eventually.py): returns as soon as the condition holds, fails naming what it waited for,
and never hides the condition's own error."""

from __future__ import annotations

import threading

import pytest

from tests.eventually import eventually


def test_returns_the_conditions_first_truthy_value_at_once() -> None:
    calls: list[int] = []

    def condition() -> list[int]:
        calls.append(1)
        return calls if len(calls) >= 3 else []

    assert eventually(condition, "three calls") == [1, 1, 1]
    assert len(calls) == 3  # not one call more once it held


def test_a_condition_that_already_holds_is_asked_once() -> None:
    calls: list[int] = []
    assert eventually(lambda: calls.append(1) or "yes", "at once") == "yes"
    assert calls == [1]


def test_waits_for_another_thread() -> None:
    done = threading.Event()
    timer = threading.Timer(0.05, done.set)
    timer.start()
    try:
        assert eventually(done.is_set, "the timer fired") is True
    finally:
        timer.cancel()


def test_a_condition_that_never_holds_fails_naming_what_was_awaited() -> None:
    with pytest.raises(AssertionError, match=r"not within 0.05 s: the agent ready"):
        eventually(lambda: False, "the agent ready", timeout=0.05)


def test_a_callable_what_is_asked_only_on_failure_and_shows_the_last_state() -> None:
    asked: list[int] = []
    state = {"n": 0}

    def count() -> bool:
        state["n"] += 1
        return False

    def what() -> str:
        asked.append(1)
        return f"seen {state['n']} times"

    with pytest.raises(AssertionError, match=r"seen \d+ times"):
        eventually(count, what, timeout=0.05)
    assert asked == [1]
    assert eventually(lambda: True, what) is True
    assert asked == [1]


def test_the_conditions_own_error_is_not_swallowed() -> None:
    def broken() -> bool:
        raise KeyError("config")

    with pytest.raises(KeyError):
        eventually(broken, "a broken condition")
