"""One holder among candidates, through the ApiClient seam: taken when free, renewed, taken over only after the
holder's record stood still for the lease's duration on the candidate's own clock; never two holders."""

from __future__ import annotations

from ipmasq.kube.lease import LeaseElector
from ipmasq.testing.kube import FakeKubeClient

PATH = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ip-masq-agent"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def candidates(client: FakeKubeClient, clock: Clock) -> tuple[LeaseElector, LeaseElector]:
    times = iter(f"2026-11-25T10:00:{i:02d}.000000Z" for i in range(60))
    return tuple(LeaseElector(client, "kube-system", "ip-masq-agent", name, duration=120, clock=clock,
                              now=lambda: next(times)) for name in ("node-a", "node-b"))  # type: ignore[return-value]


def test_the_first_candidate_takes_a_shipped_empty_lease_and_the_other_waits() -> None:
    client, clock = FakeKubeClient(), Clock()
    client.put(PATH, {"metadata": {"name": "ip-masq-agent"}, "spec": {}})
    a, b = candidates(client, clock)
    assert a.try_lead() and a.leading
    assert not b.try_lead() and b.holder == "node-a"
    client.calls.clear()
    assert a.try_lead()  # renewing: one patch on the version held, no read
    assert [verb for verb, _ in client.calls] == ["PATCH"]
    assert client.objects[PATH]["spec"]["holderIdentity"] == "node-a"


def test_a_holder_that_stops_renewing_is_replaced_after_the_duration_and_learns_it() -> None:
    client, clock = FakeKubeClient(), Clock()
    a, b = candidates(client, clock)
    assert a.try_lead()  # no Lease yet: created
    assert not b.try_lead()
    clock.now = 119.0
    assert not b.try_lead()  # the record stood still, but not for the whole duration yet
    clock.now = 120.0
    assert b.try_lead() and client.objects[PATH]["spec"]["leaseTransitions"] == 1
    assert not a.try_lead() and a.holder == "node-b"  # its blind renewal is a 409: it reads, and is not the holder


def test_a_renewing_holder_is_never_replaced_and_a_race_has_one_winner() -> None:
    client, clock = FakeKubeClient(), Clock()
    client.put(PATH, {"metadata": {"name": "ip-masq-agent"}, "spec": {}})
    a, b = candidates(client, clock)
    assert a.try_lead()
    for step in range(1, 10):
        clock.now = step * 60.0
        assert a.try_lead()
        assert not b.try_lead()
    a.release()
    assert client.objects[PATH]["spec"].get("holderIdentity") is None
    # both read it free; the first patch wins, the second carries the resourceVersion it read: 409, not two holders
    stale = client.get(PATH)
    assert b.try_lead()
    real_get = client.get
    client.get = lambda path, **_: stale  # type: ignore[method-assign]
    assert not a.try_lead()
    client.get = real_get  # type: ignore[method-assign]
    assert client.objects[PATH]["spec"]["holderIdentity"] == "node-b"


def test_a_patched_endless_duration_holds_the_lease_no_longer_than_the_candidates_own() -> None:
    client, clock = FakeKubeClient(), Clock()
    a, b = candidates(client, clock)
    assert a.try_lead()
    client.objects[PATH]["spec"]["leaseDurationSeconds"] = 2147483647  # patched by hand, or by a hostile node
    assert not b.try_lead()
    clock.now = 120.0  # the record stood still for the candidates' own duration
    assert b.try_lead() and b.leading


def test_the_holder_publishes_the_fleets_size_and_candidates_read_only_digits() -> None:
    client, clock = FakeKubeClient(), Clock()
    a, b = candidates(client, clock)
    assert a.try_lead()
    a.publish = 1000
    assert a.try_lead()  # the renewal says it
    assert client.objects[PATH]["metadata"]["annotations"] == {"ipmasq.dev/nodes": "1000"}
    assert not b.try_lead() and b.nodes == 1000
    for said in ("1e9", "²", "-5", "12345678", ""):
        client.objects[PATH]["metadata"]["annotations"]["ipmasq.dev/nodes"] = said
        c = LeaseElector(client, "kube-system", "ip-masq-agent", "node-c", duration=120, clock=clock)
        assert not c.try_lead() and c.nodes is None, said


def test_a_holder_finds_a_lease_taken_early_or_after_its_duration_and_tells_them_apart() -> None:
    """An honest candidate takes over no sooner than the duration after the holder's last renewal: found sooner, it
    was taken early (by a node that did not wait); a renewal the policy refuses (403) is read as lost too."""
    from ipmasq.errors import Forbidden
    from ipmasq.kube.lease import Lost

    client, clock = FakeKubeClient(), Clock()
    client.put(PATH, {"metadata": {"name": "ip-masq-agent"}, "spec": {}})
    a, _ = candidates(client, clock)
    assert a.try_lead()
    clock.now += 40
    client.patch(PATH, {"spec": {"holderIdentity": "node-x"}})  # taken at once
    assert not a.try_lead() and a.lost == Lost("node-x", 40.0, early=True)
    a.lost = None
    assert not a.try_lead() and a.lost is None  # found once
    clock.now += 1000
    assert a.try_lead()  # node-x never renewed: taken back after the duration
    clock.now += 130  # then it cannot renew for longer than the duration, and another takes over, as it may
    client.patch(PATH, {"spec": {"holderIdentity": "node-b"}})
    client.refuse(PATH, Forbidden(403, "ip-masq-agent on node node-a may hold the Lease only for itself"))
    assert not a.try_lead() and a.lost == Lost("node-b", 130.0, early=False)


def test_a_lease_of_another_shape_is_one_line_and_taken_by_nobody() -> None:
    """A Lease any agent may patch: a duration written as a string (kubectl edit, a hostile node) is refused by its
    shape in one line (ApiMalformed: the caller asks again later), not read as no duration."""
    import pytest

    from ipmasq.errors import ApiMalformed

    client, clock = FakeKubeClient(), Clock()
    client.put(PATH, {"metadata": {"name": "ip-masq-agent"},
                      "spec": {"holderIdentity": "node-x", "leaseDurationSeconds": "2147483647"}})
    a, _b = candidates(client, clock)
    with pytest.raises(ApiMalformed, match=r"spec\.leaseDurationSeconds is not an integer") as raised:
        a.try_lead()
    assert "\n" not in str(raised.value) and not a.leading
    assert [verb for verb, _ in client.calls] == ["GET"]  # nothing written on what could not be read
