"""The webhook's connection table decides which connections are held and until when: the deadline from the accept
to a whole first request, the keep-alive grace earned only by an answer, each source's share of the budget, room
made at the heaviest source first, the bodies' budget taken from the source holding most. Every decision here is
the table's own, on a clock the test moves."""

from __future__ import annotations

import hypothesis
from hypothesis import strategies as st

from ipmasq.webhook.connections import ConnectionLimits, ConnectionTable, Held, Stage
from tests.clock import Clock

LIMITS = ConnectionLimits(connections=12, handshake_seconds=5.0, request_seconds=10.0, keep_alive_seconds=30.0,
                          linger_seconds=2.0, body_bytes=1000)


def table(**limits: float) -> ConnectionTable[str]:
    return ConnectionTable(ConnectionLimits(**{**LIMITS.__dict__, **limits}))


def admitted(connections: ConnectionTable[str], address: str, clock: Clock, name: str = "") -> Held[str]:
    held, closed = connections.admit(address, clock())
    assert held is not None and closed == []
    held.owner = name or address
    return held


def test_a_connection_without_a_whole_request_is_closed_at_the_handshake_deadline() -> None:
    clock, connections = Clock(), table()
    silent = admitted(connections, "10.0.0.1", clock)
    clock.now += 1
    trickling = admitted(connections, "10.0.0.1", clock)
    connections.began(trickling, clock())  # a head begun, never finished: no more time for it
    clock.now += 4
    assert connections.expired(clock()) == [silent]
    clock.now += 0.9
    assert connections.expired(clock()) == []
    clock.now += 0.1
    assert connections.expired(clock()) == [trickling]
    assert len(connections) == 0 and connections.sources == 0


def test_a_whole_request_has_the_request_deadline_from_its_first_byte() -> None:
    clock, connections = Clock(), table()
    held = admitted(connections, "10.0.0.1", clock)
    clock.now += 1
    connections.began(held, clock())
    clock.now += 3
    connections.complete(held, clock())
    assert held.stage is Stage.DECIDING
    clock.now += 2  # past the handshake deadline: being decided, it stays
    assert connections.expired(clock()) == []
    clock.now += 5  # 10 s from its first byte
    assert connections.expired(clock()) == [held]


def test_only_an_answered_connection_earns_the_keep_alive_grace() -> None:
    clock, connections = Clock(), table()
    answered, silent = admitted(connections, "10.0.0.1", clock), admitted(connections, "10.0.0.2", clock)
    connections.began(answered, clock())
    connections.complete(answered, clock())
    clock.now += 1
    connections.answered(answered, clock())
    assert answered.stage is Stage.IDLE
    clock.now += 4
    assert connections.expired(clock()) == [silent]  # never answered: its deadline from the accept
    clock.now += 25.9
    assert connections.expired(clock()) == []  # 30 s from its answer
    clock.now += 0.1
    assert connections.expired(clock()) == [answered]


def test_a_kept_alive_connections_next_request_and_a_pipelined_one_have_the_request_deadline() -> None:
    clock, connections = Clock(), table()
    held = admitted(connections, "10.0.0.1", clock)
    connections.complete(held, clock())
    connections.answered(held, clock())
    clock.now += 20
    connections.began(held, clock())  # its next request: 10 s for it whole, not what was left of the grace
    assert held.stage is Stage.READING
    clock.now += 9.5
    assert connections.expired(clock()) == []
    connections.complete(held, clock())
    connections.answered(held, clock(), pipelined=True)  # the next one already begun in the same bytes
    assert held.stage is Stage.READING
    clock.now += 10
    assert connections.expired(clock()) == [held]


def test_a_closing_connection_lingers_for_the_linger_time() -> None:
    clock, connections = Clock(), table()
    held = admitted(connections, "10.0.0.1", clock)
    connections.closing(held, clock())
    clock.now += 1.9
    assert connections.expired(clock()) == []
    clock.now += 0.2
    assert connections.expired(clock()) == [held]


def test_a_source_holds_at_most_its_share_and_a_new_source_takes_room_from_it() -> None:
    clock, connections = Clock(), table()
    flood = [admitted(connections, "10.0.0.9", clock, f"flood-{i}") for i in range(12)]  # alone: the whole budget
    held, closed = connections.admit("10.0.0.9", clock())
    assert held is None and closed == []  # at its share: refused at its accept
    api, closed = connections.admit("10.1.0.1", clock())
    assert api is not None and closed == [flood[0]]  # room made at the heaviest: its oldest
    assert flood[0].gone and len(connections) == 12
    # two sources now: a share is 6, and the flood holds 11: each of its newcomers is refused
    assert connections.admit("10.0.0.9", clock()) == (None, [])
    # the ordinary client's next connections take the flood's places, down to the flood's share and further while
    # it is the heaviest
    for _ in range(5):
        assert connections.admit("10.1.0.1", clock())[0] is not None
    assert connections.holding("10.0.0.9") == 6 and connections.holding("10.1.0.1") == 6


def test_room_is_made_at_the_heaviest_source_whatever_the_newcomer() -> None:
    clock, connections = Clock(), table()
    for i in range(6):
        admitted(connections, "10.0.0.1", clock, f"a-{i}")
    b = [admitted(connections, "10.0.0.2", clock, f"b-{i}") for i in range(4)]
    c = [admitted(connections, "10.0.0.3", clock, f"c-{i}") for i in range(2)]
    for held in b + c:  # answered: worth more than a newcomer, but not more than the heavier source's
        connections.complete(held, clock())
        connections.answered(held, clock())
    order = []
    for i in range(4):
        held, closed = connections.admit(f"10.0.1.{i}", clock())
        assert held is not None
        order += [victim.owner for victim in closed]
    # 6/4/2: a's oldest, then a's next (5 > 4); a and b level at 4: the one at that count first (b), then a again
    assert order == ["a-0", "a-1", "b-0", "a-2"]
    assert all(not held.gone for held in c)


def test_within_a_source_the_connection_that_earned_least_goes_first_and_a_decision_never() -> None:
    clock, connections = Clock(), table(connections=4)
    deciding = admitted(connections, "10.0.0.1", clock, "deciding")
    reading = admitted(connections, "10.0.0.1", clock, "reading")
    idle = admitted(connections, "10.0.0.1", clock, "idle")
    unanswered = admitted(connections, "10.0.0.1", clock, "unanswered")
    connections.complete(deciding, clock())
    for held in (reading, idle):
        connections.complete(held, clock())
        connections.answered(held, clock())
    connections.began(reading, clock())
    gone = []
    for i in range(3):
        held, closed = connections.admit(f"10.0.1.{i}", clock())
        assert held is not None
        gone += [victim.owner for victim in closed]
    assert gone == ["unanswered", "idle", "reading"] and unanswered.gone
    # the one being decided is never closed for room: the next newcomer takes a lighter source's place instead
    held, closed = connections.admit("10.0.2.1", clock())
    assert held is not None and [victim.owner for victim in closed] == [None]  # the first newcomer's (no owner)
    assert not deciding.gone


def test_a_newcomer_is_refused_when_nothing_may_be_closed() -> None:
    clock, connections = Clock(), table(connections=2)
    for address in ("10.0.0.1", "10.0.0.2"):
        held = admitted(connections, address, clock)
        connections.complete(held, clock())
    assert connections.admit("10.0.0.3", clock()) == (None, [])
    assert len(connections) == 2 and connections.sources == 2


def test_a_source_at_its_share_gives_up_a_closing_connection_for_a_newcomer() -> None:
    clock, connections = Clock(), table(connections=2)
    first = admitted(connections, "10.0.0.1", clock)
    admitted(connections, "10.0.0.1", clock)
    connections.closing(first, clock())
    held, closed = connections.admit("10.0.0.1", clock())
    assert held is not None and closed == [first]


def test_a_stale_deadline_closes_nothing() -> None:
    clock, connections = Clock(), table()
    held = admitted(connections, "10.0.0.1", clock)
    connections.complete(held, clock())
    connections.answered(held, clock())
    clock.now += 5  # the deadline from its accept has passed: it was answered, so it no longer counts
    assert connections.expired(clock()) == []
    connections.forget(held)
    clock.now += 100
    assert connections.expired(clock()) == []


def test_the_bodies_budget_is_taken_from_the_source_holding_most() -> None:
    clock, connections = Clock(), table()
    big = [admitted(connections, "10.0.0.9", clock, f"big-{i}") for i in range(3)]
    for held, size in zip(big, (300, 400, 200), strict=True):
        assert connections.hold(held, size) == (True, [])
    decided = admitted(connections, "10.0.0.9", clock, "decided")
    assert connections.hold(decided, 100) == (True, [])
    connections.complete(decided, clock())  # whole: being decided, its body is not taken back
    small = admitted(connections, "10.1.0.1", clock, "api")
    fits, closed = connections.hold(small, 50)
    assert fits and [victim.owner for victim in closed] == ["big-1"]  # the largest upload of the heaviest
    assert connections.body_bytes == 300 + 200 + 100 + 50
    # the heavier one is not helped by the lighter: a source that holds more than the other is refused
    assert connections.hold(big[0], 500) == (False, [])
    # a third source takes room from the heaviest too (its decided body is not taken back)
    other = admitted(connections, "10.2.0.1", clock)
    assert connections.hold(other, 400) == (True, [big[0]])
    connections.release(other)
    assert connections.body_bytes == 200 + 100 + 50


def test_looking_for_room_looks_at_the_heaviest_source_only() -> None:
    """Under a flood past the budget, the connection to close is found at the heaviest source's first stage: work
    counted (the sources looked at for each admission), not time."""
    clock, connections = Clock(), table(connections=512)
    looked = []
    first = ConnectionTable._first

    def counted(source: object, *args: object) -> object:
        looked.append(source)
        return first(source, *args)  # type: ignore[arg-type]

    connections._first = counted  # type: ignore[method-assign]
    for i in range(4096):  # half from one address, half each from an address of its own
        held, _closed = connections.admit("10.9.9.9" if i % 2 else f"10.0.{i % 64}.{i % 251}", clock())
        if held is not None:
            held.owner = str(i)
    assert len(connections) == 512
    assert len(looked) <= 4096  # at most one source looked at for each admission past the budget


@hypothesis.given(st.lists(st.tuples(st.sampled_from(["admit", "began", "complete", "answered", "closing", "forget",
                                                      "tick", "hold", "release"]),
                                     st.integers(0, 5), st.integers(0, 40)), max_size=300))
def test_whatever_happens_the_budget_and_the_shares_hold(steps: list[tuple[str, int, int]]) -> None:
    clock, connections = Clock(), table(connections=8, body_bytes=100)
    live: list[Held[str]] = []
    for action, who, amount in steps:
        if action == "admit":
            before = connections.holding(f"10.0.0.{who}")
            others = connections.sources + (before == 0)
            held, closed = connections.admit(f"10.0.0.{who}", clock())
            if held is not None:
                live.append(held)
                # admitted only within its share (a closing one of its own given up counts as making room)
                assert before < 8 // others or any(victim.address == held.address for victim in closed)
        elif action == "tick":
            clock.now += amount / 4
            connections.expired(clock())
        elif live:
            held = live[amount % len(live)]
            if action == "hold":
                connections.hold(held, amount)
            elif action == "release":
                connections.release(held)
            elif action == "forget":
                connections.forget(held)
            else:
                getattr(connections, action)(held, clock())
        live = [held for held in live if not held.gone]
        assert len(connections) == len(live) <= 8
        assert connections.body_bytes == sum(held.body for held in live) <= 100
        counts: dict[str, int] = {}
        for held in live:
            counts[held.address] = counts.get(held.address, 0) + 1
        assert {address: connections.holding(address) for address in counts} == counts
        assert connections.sources == len(counts)
        assert connections._heaviest == max(counts.values(), default=0)


def test_an_ipv6_host_counts_as_its_64_and_ipv4_as_itself() -> None:
    """A share per /64: a host with a /64 (SLAAC, a node's pod range) gets one share, not one per address it picks."""
    from ipmasq.webhook.server import source_address

    assert source_address(("2001:db8:1:2::1", 443, 0, 0)) == source_address(("2001:db8:1:2:ffff::9", 443, 0, 0)) \
        == "2001:db8:1:2::/64"
    assert source_address(("2001:db8:1:3::1", 443, 0, 0)) != source_address(("2001:db8:1:2::1", 443, 0, 0))
    assert source_address(("::ffff:10.0.0.7", 443, 0, 0)) == "10.0.0.7"
    assert source_address(("10.0.0.7", 443)) == "10.0.0.7"
    assert source_address(("fe80::1%eth0", 443, 0, 2)) == "fe80::/64"
    assert source_address("not an address") == "not an address"
