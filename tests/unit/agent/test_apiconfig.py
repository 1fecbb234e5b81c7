"""Config from the API beside the mounted file: the newer content wins, never an older one."""

from __future__ import annotations

import logging
import threading

from ipmasq.agent.api.config import ApiConfig, ConfigChoice, configmap_source
from ipmasq.agent.origin import ConfigOrigin
from ipmasq.config.source import ConfigInput, config_digest
from ipmasq.errors import ConfigError
from ipmasq.kube.configmaps import ConfigMapState


def file_read(text: str) -> ConfigInput:
    return ConfigInput((("/etc/config/ip-masq-agent", text.encode()),))


def api_read(text: str) -> ConfigInput:
    return ConfigInput(((configmap_source("ip-masq-agent", "config"), text.encode()),))


def test_before_the_first_list_the_file_is_the_config() -> None:
    choice = ConfigChoice()
    choice.from_file(file_read("a"))
    assert choice.current() == file_read("a")


def test_the_api_shows_a_change_before_kubelet_writes_it_and_the_late_file_changes_nothing() -> None:
    choice = ConfigChoice()
    choice.from_file(file_read("a"))
    choice.from_api(api_read("a"))
    choice.from_api(api_read("b"))  # kubectl apply: the watch sees it at once
    assert choice.current() == api_read("b")
    choice.from_file(file_read("b"))  # kubelet's volume sync, up to a minute later
    assert choice.current() in (api_read("b"), file_read("b"))
    assert choice.current() is not None and choice.current().files[0][1] == b"b"


def test_a_late_kubelet_write_of_an_older_config_never_takes_the_node_back() -> None:
    choice = ConfigChoice()
    choice.from_file(file_read("a"))
    choice.from_api(api_read("a"))
    choice.from_api(api_read("b"))
    choice.from_api(api_read("c"))  # two quick edits
    choice.from_file(file_read("b"))  # kubelet catches up with the first only
    assert choice.current() == api_read("c")


def test_a_file_content_the_api_never_showed_is_newer() -> None:
    """The API out of reach for the agent (or its RBAC revoked) while kubelet still brought a new config."""
    choice = ConfigChoice()
    choice.from_api(api_read("a"))
    choice.from_file(file_read("a"))
    choice.from_file(file_read("z"))
    assert choice.current() == file_read("z")
    choice.from_api(api_read("z"))  # the API back: the same content
    assert choice.current() is not None and choice.current().files[0][1] == b"z"
    choice.from_api(api_read("y"))
    assert choice.current() == api_read("y")


def test_a_missing_configmap_is_the_defaults_like_a_missing_file() -> None:
    choice = ConfigChoice()
    choice.from_file(file_read("a"))
    choice.from_api(ConfigInput(()))
    assert choice.current() == ConfigInput(())


def test_a_file_that_turns_unreadable_after_the_api_listed_a_config_is_news() -> None:
    choice = ConfigChoice()
    choice.from_file(file_read("a"))
    choice.from_api(api_read("a"))
    error = ConfigError("a FIFO, not a regular file", source="/etc/config/ip-masq-agent")
    choice.from_file(error)
    assert choice.current() is error


def _states(api: ApiConfig, *states: ConfigMapState) -> None:
    for state in states:
        api._changed(state)


def test_apiconfig_merges_its_configmaps_in_name_order_once_every_one_was_listed() -> None:
    pokes: list[int] = []
    api = ApiConfig(client=None, namespace="kube-system", names=["ip-masq-b", "ip-masq-a"],  # type: ignore[arg-type]
                    key="config", log=logging.getLogger("test"), poke=lambda: pokes.append(1),
                    stop=threading.Event())
    _states(api, ConfigMapState("kube-system", "ip-masq-b", True, b"b: 1\n", "u2", "7"))
    # one of two listed: the API's view is not whole yet
    assert api.choose(file_read("f")) == (file_read("f"), ConfigOrigin("file"))
    _states(api, ConfigMapState("kube-system", "ip-masq-a", True, b"a: 1\n", "u1", "8"))
    chosen, origin = api.choose(file_read("f"))
    assert isinstance(chosen, ConfigInput)
    assert chosen.files == (("configmap/ip-masq-a[config]", b"a: 1\n"), ("configmap/ip-masq-b[config]", b"b: 1\n"))
    # where it came from, as a value: the resourceVersions of this very content, its digest computed once
    assert origin == ConfigOrigin("api", digest=config_digest((b"a: 1\n", b"b: 1\n")),
                                  configmaps=(("ip-masq-a", "8"), ("ip-masq-b", "7")), exists=True)
    assert api.digest() == origin.digest
    assert len(pokes) == 1  # once the API's view is whole


def test_binary_data_that_is_not_base64_is_a_config_error_naming_the_configmap() -> None:
    api = ApiConfig(client=None, namespace="kube-system", names=["ip-masq-agent"],  # type: ignore[arg-type]
                    key="config", log=logging.getLogger("test"), poke=lambda: None, stop=threading.Event())
    _states(api, ConfigMapState("kube-system", "ip-masq-agent", True, None, "u", "3",
                                bad_value="binaryData that is not base64"))
    chosen, origin = api.choose(file_read("f"))
    assert isinstance(chosen, ConfigError) and origin.source == "api"
    assert chosen.located() == "configmap/ip-masq-agent[config]: binaryData that is not base64: not read"


def test_a_stale_volume_read_first_after_the_apis_list_does_not_win() -> None:
    """The agent restarted right after an edit: the API's list arrives before the loop's first read of the volume,
    which kubelet has not updated yet."""
    choice = ConfigChoice()
    choice.from_api(api_read("new"))
    choice.from_file(file_read("old"))
    assert choice.current() == api_read("new")
