"""The isolated server (as `ipmasq webhook` runs it): reviews that take real work are decided in the decision
process, so an ordinary review never waits for them; one abandoned there stops; the process ending is one review's
500. Every wait is on a condition, with a generous deadline that only guards against a hang: the decision process
is held still (SIGSTOP) to stand for a decision that takes long, whatever the machine's load."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ipmasq.errors import WorkOutgrown
from ipmasq.webhook.answer import Outgrown, decision
from ipmasq.webhook.certificate import CertificateSet
from ipmasq.webhook.review import respond
from ipmasq.webhook.server import HANDOFF_STEPS, ISOLATED_SMALL_BODY_BYTES, WebhookServer, serve
from ipmasq.webhook.worker import DecisionWorker
from tests.eventually import eventually
from tests.hostile.admission import overlapping_rules, plain_rules
from tests.unit.webhook.test_server_hostile import ask, review_body

HANG_GUARD_SECONDS = 60.0  # not a bound on anything measured: only how long a broken test waits before failing


@pytest.fixture
def isolated(certificate: CertificateSet) -> Iterator[WebhookServer]:
    logged: list[str] = []
    running = WebhookServer(("127.0.0.1", 0), respond, isolated=True, log=logged.append)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    running.logged = logged  # type: ignore[attr-defined]
    serve(running)
    assert running.accepting.wait(HANG_GUARD_SECONDS)  # its decision process started and ready
    assert running.decision_pid is not None
    try:
        yield running
    finally:
        running.shutdown()
        running.server_close()


def _asking(server: WebhookServer, certificate: CertificateSet, body: bytes,
            into: list[tuple[int, dict[str, Any], float]]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.append(ask(server, certificate, body)))
    thread.start()
    return thread


def test_an_ordinary_review_is_answered_while_a_large_one_is_being_decided(isolated: WebhookServer,
                                                                           certificate: CertificateSet) -> None:
    """Two reviews of 1,600 rules decided in threads took the event loop's turns (the GIL): ordinary reviews
    beside them waited over 1 s. Now the large one's decision cannot even begin (its process is stopped) and the
    ordinary one is answered all the same; the large one is answered once its process goes on."""
    large = review_body(plain_rules(400))
    assert len(large) > ISOLATED_SMALL_BODY_BYTES
    pid = isolated.decision_pid
    assert pid is not None
    answers: list[tuple[int, dict[str, Any], float]] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        waiting = _asking(isolated, certificate, large, answers)
        for _ in range(3):
            status, answer, _seconds = ask(isolated, certificate, review_body())
            assert status == 200 and answer["response"]["allowed"] is True
        assert answers == []  # the large one is still in the stopped process
    finally:
        os.kill(pid, signal.SIGCONT)
    waiting.join(HANG_GUARD_SECONDS)
    assert [status for status, _answer, _seconds in answers] == [200]
    assert answers[0][1]["response"] == respond(json.loads(large))[0]["response"]


def test_a_small_review_whose_checks_outgrow_the_handoff_is_decided_apart_with_the_same_verdict(
        isolated: WebhookServer, certificate: CertificateSet) -> None:
    """A small body can still ask for the whole budget (100 nested rules: 26,000 steps in 11 KB): past
    HANDOFF_STEPS in a thread it is handed to the decision process, which decides it whole."""
    body = review_body(overlapping_rules(100))
    assert len(body) <= ISOLATED_SMALL_BODY_BYTES
    with pytest.raises(WorkOutgrown):
        respond(json.loads(body), handoff=HANDOFF_STEPS)
    started = time.monotonic()  # the decision's own start, which it carries (no bound on it here)
    assert isinstance(decision(respond, bytearray(body), started, threading.Event(), HANDOFF_STEPS), Outgrown)
    # an ordinary review stays well inside it
    assert not isinstance(decision(respond, bytearray(review_body()), started, threading.Event(), HANDOFF_STEPS),
                          Outgrown)
    pid = isolated.decision_pid
    assert pid is not None
    answers: list[tuple[int, dict[str, Any], float]] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        waiting = _asking(isolated, certificate, body, answers)
        status, _answer, _seconds = ask(isolated, certificate, review_body())
        assert status == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    waiting.join(HANG_GUARD_SECONDS)
    assert [status for status, _answer, _seconds in answers] == [200]
    assert answers[0][1]["response"] == respond(json.loads(body))[0]["response"]


def test_a_decision_abandoned_in_the_process_stops_there_and_the_process_decides_the_next() -> None:
    worker = DecisionWorker(functools.partial(decision, respond))
    worker.start()
    try:
        pid = worker.pid
        assert pid is not None
        abandoned, out = threading.Event(), []
        os.kill(pid, signal.SIGSTOP)
        try:
            body = bytearray(review_body(overlapping_rules(200)))  # 0.2 s of checks, a budget step at each rule
            thread = threading.Thread(target=lambda: out.append(worker.decide(body, time.monotonic(), abandoned)))
            thread.start()
            eventually(lambda: worker._current[1] is abandoned, "the decision sent to the process",
                       timeout=HANG_GUARD_SECONDS)
            abandoned.set()
            worker.abandon(abandoned)  # what the server does when the connection goes
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(HANG_GUARD_SECONDS)
        assert out == [None]  # stopped at its next step, no answer for nobody
        # a later decision is not taken for the abandoned one, and the same process makes it
        answer = worker.decide(bytearray(review_body()), time.monotonic(), threading.Event())
        assert isinstance(answer, tuple) and answer[0] == 200
        assert worker.pid == pid
    finally:
        worker.close()


def test_the_decision_process_ending_mid_decision_is_one_500_and_the_next_review_is_decided(
        isolated: WebhookServer, certificate: CertificateSet) -> None:
    large = review_body(plain_rules(400))
    pid = isolated.decision_pid
    assert pid is not None
    answers: list[tuple[int, dict[str, Any], float]] = []
    os.kill(pid, signal.SIGSTOP)
    waiting = _asking(isolated, certificate, large, answers)
    worker = isolated._worker
    assert worker is not None
    eventually(lambda: worker._current[0] != 0, "the decision sent to the process", timeout=HANG_GUARD_SECONDS)
    os.kill(pid, signal.SIGKILL)
    waiting.join(HANG_GUARD_SECONDS)
    assert [status for status, _answer, _seconds in answers] == [500]
    assert any("could not be decided" in line for line in isolated.logged)  # type: ignore[attr-defined]
    status, answer, _seconds = ask(isolated, certificate, large)
    assert status == 200 and answer["response"]["allowed"] is True
    assert isolated.decision_pid not in (None, pid)
