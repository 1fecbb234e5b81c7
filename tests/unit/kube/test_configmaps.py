"""Following a ConfigMap: list, watch from the list's version, list again on 410, back off on anything else and then
resume the watch from the last version seen."""

from __future__ import annotations

import base64
import threading

from ipmasq.errors import ApiUnreachable, Forbidden, Gone
from ipmasq.kube.client import WatchEvent
from ipmasq.kube.configmaps import ConfigMapFollower, ConfigMapState, configmap_state
from ipmasq.testing.kube import FakeKubeClient
from tests.eventually import eventually

PATH = "/api/v1/namespaces/kube-system/configmaps"


def configmap(text: str, version: str = "5") -> dict[str, object]:
    return {"metadata": {"name": "ip-masq-agent", "uid": "u1", "resourceVersion": version}, "data": {"config": text}}


def test_the_key_as_kubelet_writes_it_data_or_binary_data() -> None:
    assert configmap_state("ns", "n", "config", None) == ConfigMapState("ns", "n", exists=False)
    assert configmap_state("ns", "n", "config", configmap("a: 1")).content == b"a: 1"
    binary = {"metadata": {}, "binaryData": {"config": base64.b64encode(b"\xff\xfe").decode()}}
    assert configmap_state("ns", "n", "config", binary).content == b"\xff\xfe"
    assert configmap_state("ns", "n", "config", {"metadata": {}, "binaryData": {"config": "!!"}}).bad_value
    other_key = configmap_state("ns", "n", "config", {"metadata": {}, "data": {"other": "x"}})
    assert other_key.exists and other_key.content is None
    assert configmap_state("ns", "n", "config", {"metadata": "garbage", "data": ["x"]}).content is None


Followed = tuple[ConfigMapFollower, list[ConfigMapState], list[str | None], threading.Event]


def _follow(client: FakeKubeClient) -> Followed:
    seen: list[ConfigMapState] = []
    troubles: list[str | None] = []
    stop = threading.Event()
    follower = ConfigMapFollower(client, "kube-system", "ip-masq-agent", "config", on_change=seen.append,
                                 on_trouble=troubles.append, stop=stop)
    follower.start()
    return follower, seen, troubles, stop


def test_list_then_watch_then_relist_on_gone_and_recover_after_trouble() -> None:
    client = FakeKubeClient()
    client.put(f"{PATH}/ip-masq-agent", configmap("a"))
    _follower, seen, troubles, stop = _follow(client)
    try:
        eventually(lambda: len(seen) == 1, "the first state")
        assert seen[0].content == b"a"
        client.watch_events.put(WatchEvent("MODIFIED", configmap("b", "9")))
        eventually(lambda: len(seen) == 2, "a second state")
        assert seen[1].content == b"b"
        client.watch_events.put(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "12"}}))
        client.watch_events.put(WatchEvent("DELETED", configmap("b", "13")))
        eventually(lambda: len(seen) == 3, "a third state")
        assert not seen[2].exists
        client.put(f"{PATH}/ip-masq-agent", configmap("c"))
        client.watch_events.put(Gone(410, "too old resource version"))  # relist at once
        eventually(lambda: len(seen) == 4, "a fourth state")
        assert seen[3].content == b"c"
        assert troubles == []
        client.refuse(PATH, Forbidden(403, "configmaps is forbidden"))
        client.watch_events.put(ApiUnreachable("watch: the stream broke"))
        eventually(lambda: len(troubles) >= 1, "a trouble reported")
        assert "stream broke" in str(troubles[0])
        eventually(lambda: len(troubles) >= 2, "a second trouble")  # the resumed watch was refused: another backoff
        client.watch_events.put(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "20"}}))
        eventually(lambda: None in troubles, "the trouble's end")  # a later watch worked
        assert any(t is not None and "forbidden" in t for t in troubles)
    finally:
        stop.set()
        client.watch_events.put(None)
    verbs = [verb for verb, _ in client.calls]
    assert verbs[:2] == ["GET", "WATCH"]


def test_after_trouble_the_watch_resumes_from_the_last_version_seen_without_a_list() -> None:
    client = FakeKubeClient()
    client.put(f"{PATH}/ip-masq-agent", configmap("a"))
    follower, seen, troubles, stop = _follow(client)
    try:
        eventually(lambda: len(seen) == 1, "the first state")
        client.watch_events.put(WatchEvent("MODIFIED", configmap("b", "150")))
        client.watch_events.put(WatchEvent("BOOKMARK", {"metadata": {"resourceVersion": "160"}}))
        eventually(lambda: follower.resource_version == "160", "resourceVersion 160 seen")
        client.watch_events.put(ApiUnreachable("watch: the stream broke"))  # the API server restarting
        eventually(lambda: len(client.watch_queries) == 2, "a second watch")
        assert client.watch_queries[1]["resourceVersion"] == "160"
        assert [verb for verb, _ in client.calls].count("GET") == 1 and follower.relists == 0
        client.watch_events.put(WatchEvent("MODIFIED", configmap("c", "170")))
        eventually(lambda: len(seen) == 3 and troubles[-1:] == [None], "a third state, trouble over")
        lists: list[dict[str, str]] = []
        real_get = client.get
        client.get = lambda path, query=None: lists.append(dict(query or {})) or real_get(  # type: ignore[method-assign]
            path, query=query)
        client.watch_events.put(Gone(410, "too old resource version"))  # only a 410 makes it list again
        eventually(lambda: follower.relists == 1 and len(lists) == 1, "one relist")
        # from the server's cache, not older than what was seen (after a restart the cache starts newer)
        assert lists[0] == {"fieldSelector": "metadata.name=ip-masq-agent", "resourceVersion": "170",
                            "resourceVersionMatch": "NotOlderThan"}
    finally:
        stop.set()
        client.watch_events.put(None)


def test_the_wait_after_trouble_is_drawn_from_zero_to_the_backoff(monkeypatch: object) -> None:
    import ipmasq.kube.configmaps as module

    drawn: list[tuple[float, float]] = []
    real = module.random.uniform

    def uniform(low: float, high: float) -> float:
        if threading.current_thread().name != "configmap-backoff-test":  # another test's thread
            return real(low, high)
        drawn.append((low, high))
        return 0.0

    monkeypatch.setattr(module.random, "uniform", uniform)  # type: ignore[attr-defined]
    client = FakeKubeClient()
    client.refuse(PATH, *[ApiUnreachable("connection refused")] * 4)
    seen: list[ConfigMapState] = []
    stop = threading.Event()
    ConfigMapFollower(client, "kube-system", "backoff-test", "config", on_change=seen.append,
                      on_trouble=lambda _why: None, stop=stop).start()
    try:
        eventually(lambda: len(seen) == 1, "the first state")
    finally:
        stop.set()
        client.watch_events.put(None)
    backoffs = [pair for pair in drawn if pair[0] == 0.0]
    assert backoffs[:4] == [(0.0, 0.8), (0.0, 1.6), (0.0, 3.2), (0.0, 6.4)]


def test_a_server_answering_every_watch_with_410_gets_lists_spaced_by_the_growing_backoff(monkeypatch: object) -> None:
    """A list's success does not reset the backoff (only a watch that delivered does): a relist storm is not possible
    (client-go's reflector waits the same way)."""
    import ipmasq.kube.configmaps as module

    drawn: list[tuple[float, float]] = []
    real = module.random.uniform

    def uniform(low: float, high: float) -> float:
        if threading.current_thread().name != "configmap-gone-test":
            return real(low, high)
        drawn.append((low, high))
        return 0.0

    monkeypatch.setattr(module.random, "uniform", uniform)  # type: ignore[attr-defined]
    client = FakeKubeClient()
    client.put(f"{PATH}/gone-test", configmap("a"))
    for _ in range(5):
        client.watch_events.put(Gone(410, "too old resource version"))
    stop = threading.Event()
    follower = ConfigMapFollower(client, "kube-system", "gone-test", "config", on_change=lambda _s: None,
                                 on_trouble=lambda _why: None, stop=stop)
    follower.start()
    try:
        eventually(lambda: follower.relists == 5 and len([p for p in drawn if p[0] == 0.0]) >= 5,
                   "five relists, each after a wait drawn from zero")
    finally:
        stop.set()
        client.watch_events.put(None)
    assert [pair for pair in drawn if pair[0] == 0.0][:5] == [(0.0, 0.8), (0.0, 1.6), (0.0, 3.2), (0.0, 6.4),
                                                              (0.0, 12.8)]
    assert [verb for verb, _ in client.calls].count("GET") == 6  # the first list and one per 410, no more


def test_a_configmap_of_another_shape_cannot_be_read_and_says_which_field() -> None:
    state = configmap_state("kube-system", "ip-masq-agent", "config",
                            {"metadata": {"name": "ip-masq-agent"}, "data": {"config": {"nonMasqueradeCIDRs": []}}})
    assert state.exists and state.content is None and state.bad_value is not None
    assert "ConfigMap kube-system/ip-masq-agent.data.config is not a string" in state.bad_value
    assert "\n" not in state.bad_value
    whole = configmap_state("kube-system", "x", None, {"metadata": {"name": "x"}, "binaryData": {"a": 5}})
    assert whole.bad_value is not None and "binaryData.a is not a string" in whole.bad_value and not whole.keys
