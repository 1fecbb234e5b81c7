"""Trouble (ipmasq.agent.trouble): what keeps failing is logged once per distinct line and its end once, never once
per retry; a reason from outside is one line in the log, whatever it holds."""

from __future__ import annotations

import logging
import threading

import pytest

from ipmasq.agent.trouble import Trouble


class Records(logging.Handler):
    """The records a logger was given, formatted as the agent's handler would take them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelno, record.getMessage()))


@pytest.fixture
def records() -> Records:
    handler = Records()
    log = logging.getLogger("ipmasq.test.trouble")
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    return handler


def _trouble(over: str | None = "the API server answers again", level: int = logging.WARNING) -> Trouble:
    return Trouble(logging.getLogger("ipmasq.test.trouble"), said="cannot reach the API server: %s (retrying)",
                   over=over, level=level)


def test_a_trouble_that_repeats_is_said_once_and_its_end_once(records: Records) -> None:
    trouble = _trouble()
    assert trouble("connection refused") is True
    assert [trouble("connection refused") for _ in range(1000)] == [False] * 1000
    assert trouble.ended() is True
    assert trouble.ended() is False
    assert records.seen == [(logging.WARNING, "cannot reach the API server: connection refused (retrying)"),
                            (logging.INFO, "the API server answers again")]


def test_each_change_of_the_line_is_news_and_going_back_is_news_again(records: Records) -> None:
    trouble = _trouble()
    said = [trouble(why) for why in ["refused", "refused", "timed out", "timed out", "refused"]]
    assert said == [True, False, True, False, True]
    assert [text for _, text in records.seen] == [f"cannot reach the API server: {why} (retrying)"
                                                  for why in ["refused", "timed out", "refused"]]
    assert trouble.current == "refused"


def test_after_its_end_the_same_trouble_is_news_again(records: Records) -> None:
    trouble = _trouble()
    trouble("refused")
    trouble.ended()
    assert trouble.current is None
    assert trouble("refused") is True
    assert len(records.seen) == 3


def test_an_end_without_a_trouble_says_nothing(records: Records) -> None:
    trouble = _trouble()
    assert trouble.ended() is False
    assert records.seen == []


def test_no_over_line_logs_nothing_at_the_end_but_still_ends_it(records: Records) -> None:
    trouble = _trouble(over=None, level=logging.ERROR)
    trouble("refused")
    assert trouble.ended() is True
    assert records.seen == [(logging.ERROR, "cannot reach the API server: refused (retrying)")]
    assert trouble("refused") is True


def test_a_reason_is_written_verbatim_never_as_a_format(records: Records) -> None:
    trouble = _trouble()
    trouble("HTTP 500: %s %d %(name)s %%")
    assert records.seen == [(logging.WARNING, "cannot reach the API server: HTTP 500: %s %d %(name)s %% (retrying)")]


def test_a_reason_that_holds_a_newline_or_an_escape_is_one_line(records: Records) -> None:
    trouble = _trouble()
    forged = "refused\n2024-05-01T10:00:00.000Z ipmasq agent: INFO config loaded\x1b[2J\r\x00"
    assert trouble(forged) is True
    ((_level, text),) = records.seen
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\x00" not in text
    assert text == ("cannot reach the API server: refused\\n2024-05-01T10:00:00.000Z ipmasq agent: INFO config "
                    "loaded\\x1b[2J\\r\\x00 (retrying)")
    assert trouble(forged) is False  # the same reason again, however it was written
    assert len(records.seen) == 1


def test_the_reporter_takes_a_reason_or_none_under_its_lock_from_many_threads(records: Records) -> None:
    trouble = _trouble()
    lock = threading.Lock()
    report = trouble.reporter(lock)
    start = threading.Barrier(8)

    def retry() -> None:
        start.wait()
        for _ in range(500):
            report("watch: connection reset")

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report(None)
    report(None)
    assert records.seen == [(logging.WARNING, "cannot reach the API server: watch: connection reset (retrying)"),
                            (logging.INFO, "the API server answers again")]


def test_the_reporter_holds_the_lock_while_it_logs() -> None:
    lock = threading.Lock()
    held: list[bool] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(lock.locked())

    log = logging.getLogger("ipmasq.test.trouble.lock")
    log.handlers[:] = [Probe()]
    log.propagate = False
    report = Trouble(log, said="%s", over="over").reporter(lock)
    report("a")
    report(None)
    assert held == [True, True]
