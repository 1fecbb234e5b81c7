"""Which connections the webhook holds, and for how long: one budget of connections and one of request bodies, shared
fairly between the source addresses that hold them, and each connection's deadline set by what it has done. Pure:
no socket, no event loop and no clock of its own; the server says what happened and when (its clock), and is told
which connections to close.

The rules, because a peer on the pod network reaches the port as well as the API server does:
- a connection has HANDSHAKE_SECONDS from its accept to send a whole first request (its TLS handshake, the head and
  the body): one that finished its handshake and says nothing, or trickles a head, is closed then;
- only a connection that has been answered earns the keep-alive grace: KEEP_ALIVE_SECONDS idle until its next
  request, which then has REQUEST_SECONDS from its first byte, decision included (so has the first once whole);
- the budget (MAX_CONNECTIONS) is shared between the sources holding connections, a source's share being the
  budget divided by their number (a newcomer's counted): a new connection from a source that holds its share takes
  the place of one of that source's own that is closing, or is refused at its accept, before any TLS is made (a
  source's connections are told apart by what they did, not by whose they are: an idle one, answered before, is
  worth more than a newcomer);
- past the budget, room is made at the heaviest source (the one holding most connections), and of its connections
  the one that has earned least: closing, then never answered (the oldest first), then idle between requests (idle
  longest first), then reading its next request; never one whose request is being decided. An ordinary client's
  new connection (the API server's) therefore takes room from a flood's, not the other way round;
- request bodies held at once (BODY_BUDGET_BYTES): one that does not fit takes room from the source holding most
  body bytes, if it holds more than the requester's would, by closing its largest upload still being read.

A held connection's memory is bounded by the server (ssl's state, about 17 KiB after a handshake, and 17 KiB more
while a record is unfinished; a head of at most 8 KiB; its body within the bodies' budget), so the budget can be
eight times what it was (128); figures in docs/measurements.md.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BODY_BUDGET_BYTES", "HANDSHAKE_SECONDS", "KEEP_ALIVE_SECONDS", "LINGER_SECONDS", "MAX_CONNECTIONS",
           "REQUEST_SECONDS", "ConnectionLimits", "ConnectionTable", "Held", "Stage"]

# Connections held at once. Each costs about 19 KiB once secure (OpenSSL's state is 17 KiB of it) and about 45 KiB
# in the worst shape a peer can give it (an unfinished TLS record and an unfinished head): 1,024 of them are 19-45
# MiB, within the Deployment's memory limit beside the bodies' budget and the decision process.
MAX_CONNECTIONS = 1024
HANDSHAKE_SECONDS = 5.0  # from the accept to a whole first request (the API server sends it at once)
REQUEST_SECONDS = 10.0  # a request from its first byte, decision included: the API server gives a review 30 s at most
KEEP_ALIVE_SECONDS = 30.0  # an answered connection idle until its next request (the API server keeps them for reuse)
LINGER_SECONDS = 2.0  # a closed connection's peer may still send this long (its bytes are dropped unread)
# All request bodies held at once (read, or waiting for their decision): two of the largest and room for the rest.
BODY_BUDGET_BYTES = 48 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    connections: int = MAX_CONNECTIONS
    handshake_seconds: float = HANDSHAKE_SECONDS
    request_seconds: float = REQUEST_SECONDS
    keep_alive_seconds: float = KEEP_ALIVE_SECONDS
    linger_seconds: float = LINGER_SECONDS
    body_bytes: int = BODY_BUDGET_BYTES


class Stage(enum.IntEnum):
    """What a connection has done, in the order room is made (lowest first)."""

    CLOSING = 0  # said and done, its peer's last bytes read and dropped
    UNANSWERED = 1  # accepted, no whole request yet: the handshake, the head, the body
    IDLE = 2  # answered, waiting for its next request: the keep-alive grace
    READING = 3  # answered before, reading its next request
    DECIDING = 4  # a whole request being decided and answered: never closed to make room


_EVICTABLE = (Stage.CLOSING, Stage.UNANSWERED, Stage.IDLE, Stage.READING)
_UPLOADING = (Stage.UNANSWERED, Stage.READING)

T = TypeVar("T")


class Held(Generic[T]):
    """One connection as the table holds it; `owner` is the server's own object for it."""

    __slots__ = ("began", "body", "due", "gone", "owner", "source", "stage")

    def __init__(self, source: _Source[T], stage: Stage, due: float) -> None:
        self.source = source
        self.stage = stage
        self.due = due  # when it is closed unless it does something first
        self.began: float | None = None  # its request's first byte
        self.body = 0  # body bytes held
        self.gone = False
        self.owner: T | None = None

    @property
    def address(self) -> str:
        return self.source.address


class _Source(Generic[T]):
    __slots__ = ("address", "body", "count", "stages")

    def __init__(self, address: str) -> None:
        self.address = address
        self.count = 0
        self.body = 0
        # by stage (all but DECIDING), each in the order its connections entered it
        self.stages: tuple[dict[Held[T], None], ...] = ({}, {}, {}, {})


class ConnectionTable(Generic[T]):
    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._sources: dict[str, _Source[T]] = {}
        # sources by how many connections they hold: the heaviest is found without a look at every source
        self._by_count: dict[int, dict[_Source[T], None]] = {}
        self._heaviest = 0
        self._count = 0
        self._body = 0
        # deadlines: (due, sequence, connection), an entry stale once its connection's `due` moved on
        self._deadlines: list[tuple[float, int, Held[T]]] = []
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return self._count

    @property
    def sources(self) -> int:
        return len(self._sources)

    @property
    def body_bytes(self) -> int:
        return self._body

    def holding(self, address: str) -> int:
        """Connections `address` holds."""
        source = self._sources.get(address)
        return source.count if source is not None else 0

    # ---- connections --------------------------------------------------------------------------------------------

    def admit(self, address: str, now: float) -> tuple[Held[T] | None, list[Held[T]]]:
        """A connection accepted from `address`: its entry (None: refused, to be closed at once) and the
        connections closed to make room for it (already forgotten here; their owners to be closed)."""
        source = self._sources.get(address)
        closed: list[Held[T]] = []
        if source is not None and source.count >= self.limits.connections // len(self._sources):
            own = self._first(source, (Stage.CLOSING,))
            if own is None:
                return None, closed
            self.forget(own)
            closed.append(own)
            source = self._sources.get(address)
        if source is None:
            source = self._sources[address] = _Source(address)
        held: Held[T] = Held(source, Stage.UNANSWERED, now + self.limits.handshake_seconds)
        self._count_move(source, +1)
        source.stages[Stage.UNANSWERED][held] = None
        self._count += 1
        self._due_at(held)
        while self._count > self.limits.connections:
            victim = self._heaviest_evictable(held)
            if victim is None:
                self.forget(held)
                return None, closed
            self.forget(victim)
            closed.append(victim)
        return held, closed

    def began(self, held: Held[T], now: float) -> None:
        """A request's first byte: an idle connection's next request has REQUEST_SECONDS from now; a first request
        keeps its HANDSHAKE_SECONDS (and has REQUEST_SECONDS from now once whole)."""
        if held.gone or held.began is not None:
            return
        if held.stage is Stage.UNANSWERED:
            held.began = now
        elif held.stage is Stage.IDLE:
            held.began = now
            self._move(held, Stage.READING, now + self.limits.request_seconds)

    def complete(self, held: Held[T], now: float) -> None:
        """A whole request: being decided (or answered) from now, within REQUEST_SECONDS of its first byte."""
        if held.gone or held.stage not in (Stage.UNANSWERED, Stage.READING, Stage.IDLE):
            return
        began = held.began if held.began is not None else now
        self._move(held, Stage.DECIDING, began + self.limits.request_seconds)

    def answered(self, held: Held[T], now: float, *, pipelined: bool = False) -> None:
        """Its request answered: the keep-alive grace, or, with the next request already begun (pipelined),
        REQUEST_SECONDS for that one from now."""
        if held.gone or held.stage is Stage.CLOSING:
            return
        if pipelined:
            held.began = now
            self._move(held, Stage.READING, now + self.limits.request_seconds)
        else:
            held.began = None
            self._move(held, Stage.IDLE, now + self.limits.keep_alive_seconds)

    def closing(self, held: Held[T], now: float) -> None:
        """Said and done: its peer's last bytes are read and dropped for LINGER_SECONDS at most."""
        if not held.gone and held.stage is not Stage.CLOSING:
            self._move(held, Stage.CLOSING, now + self.limits.linger_seconds)

    def forget(self, held: Held[T]) -> None:
        """The connection is gone (closed, or closed to make room): its place and its body bytes are free."""
        if held.gone:
            return
        held.gone = True
        self.release(held)
        source = held.source
        if held.stage is not Stage.DECIDING:
            del source.stages[held.stage][held]
        self._count -= 1
        self._count_move(source, -1)
        if source.count == 0:
            del self._sources[source.address]

    def expired(self, now: float) -> list[Held[T]]:
        """The connections whose deadline has come, forgotten here (their owners to be closed)."""
        ended: list[Held[T]] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            due, _sequence, held = heapq.heappop(deadlines)
            if not held.gone and held.due == due:
                self.forget(held)
                ended.append(held)
        return ended

    # ---- request bodies -------------------------------------------------------------------------------------------

    def hold(self, held: Held[T], size: int) -> tuple[bool, list[Held[T]]]:
        """`size` more bytes of `held`'s body: whether they may be held, and the connections closed to make room
        (forgotten here, their owners to be closed): the largest uploads of the source holding most, while that
        source holds more than `held`'s would."""
        closed: list[Held[T]] = []
        if held.gone:
            return False, closed
        while self._body + size > self.limits.body_bytes:
            victim = self._heaviest_upload(held, size)
            if victim is None:
                return False, closed
            self.forget(victim)
            closed.append(victim)
        held.body += size
        held.source.body += size
        self._body += size
        return True, closed

    def release(self, held: Held[T]) -> None:
        """`held`'s body is no longer held (decided, refused, or its connection gone)."""
        self._body -= held.body
        held.source.body -= held.body
        held.body = 0

    # ---- inside -------------------------------------------------------------------------------------------------

    def _move(self, held: Held[T], stage: Stage, due: float) -> None:
        stages = held.source.stages
        if held.stage is not Stage.DECIDING:
            del stages[held.stage][held]
        if stage is not Stage.DECIDING:
            stages[stage][held] = None
        held.stage = stage
        held.due = due
        self._due_at(held)

    def _due_at(self, held: Held[T]) -> None:
        heapq.heappush(self._deadlines, (held.due, next(self._sequence), held))

    def _count_move(self, source: _Source[T], step: int) -> None:
        by_count = self._by_count
        if source.count:
            bucket = by_count[source.count]
            del bucket[source]
            if not bucket:
                del by_count[source.count]
        source.count += step
        if source.count:
            by_count.setdefault(source.count, {})[source] = None
            self._heaviest = max(self._heaviest, source.count)
        while self._heaviest and self._heaviest not in by_count:  # a step of one: at most one step down
            self._heaviest -= 1

    @staticmethod
    def _first(source: _Source[T], stages: tuple[Stage, ...], besides: Held[T] | None = None) -> Held[T] | None:
        for stage in stages:
            for held in source.stages[stage]:
                if held is not besides:
                    return held
        return None

    def _heaviest_evictable(self, besides: Held[T]) -> Held[T] | None:
        """The first connection of the heaviest source that may be closed to make room; a source whose connections
        are all being decided is passed over for the next heaviest."""
        for count in range(self._heaviest, 0, -1):
            for source in self._by_count.get(count, ()):
                victim = self._first(source, _EVICTABLE, besides)
                if victim is not None:
                    return victim
        return None

    def _heaviest_upload(self, held: Held[T], size: int) -> Held[T] | None:
        """The largest upload still being read of the source holding most body bytes, if it holds more than
        `held`'s source would with `size` more. A look at every source, on the rare path of a full budget."""
        floor = held.source.body + size
        heaviest: _Source[T] | None = None
        for source in self._sources.values():
            if source is not held.source and source.body > floor and (heaviest is None or
                                                                      source.body > heaviest.body):
                heaviest = source
        if heaviest is None:
            return None
        uploads = [other for stage in _UPLOADING for other in heaviest.stages[stage] if other.body]
        return max(uploads, key=lambda other: other.body, default=None)
