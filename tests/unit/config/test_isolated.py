"""The agent's config loading in a child process (ipmasq.config.isolated): the same config or the same error as
loading in-process, a failing child is one line and retried, and the agent's own process never imports PyYAML."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ipmasq.agent.reconcile import Reconciler, StopRequested
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config.isolated import decode_config, encode_config, encode_options, load_config_isolated
from ipmasq.config.model import MasqConfig, Rule
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError, IpmasqError
from ipmasq.options import PolicyOptions, PortRange
from ipmasq.testing import FakeIptables
from tests.unit.config.test_document_hostile import NESTED

OPTIONS = PolicyOptions(node_name="gke-prod-egress-pool-1")
RULES = """\
nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, "fd00::/8"]
masqueradeCIDRs: [10.11.0.0/24]
cidrLimit: 70
masqLinkLocal: true
masqLinkLocalIPv6: y
resyncInterval: 2m30s
enableIPv6: true
rules:
  - name: partner
    destinations: [203.0.113.0/24]
    sources: [10.8.0.0/14]
    protocol: tcp
    ports: [443, "8000-8099"]
    nodes: ["gke-prod-egress-pool-*"]
    action: snat
    snatTo: 10.128.0.9
  - name: v6-keep
    destinations: ["2001:db8::/32"]
    action: preserve
"""
GOOD: dict[str, tuple[tuple[str, bytes], ...]] = {
    "none (the defaults)": (),
    "empty file": (("/etc/config/ip-masq-agent", b""),),
    "rules, IPv6, every key": (("/etc/config/ip-masq-agent", RULES.encode()),),
    "json": (("/etc/config/ip-masq-agent", b'{"nonMasqueradeCIDRs": ["10.0.0.0/8"], "resyncInterval": "1s"}'),),
    "a directory of files": (("/etc/config/ip-masq-a", b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"),
                             ("/etc/config/ip-masq-b", b"masqueradeCIDRs: [10.1.0.0/16]\nresyncInterval: 5s\n")),
    "a warning": (("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8]\nenableIPv6: false\n"),),
    "a file name no codec would like": (("/etc/config/ip-masq-\udcff \u00e9\n", b"cidrLimit: 3\n"),),
}
BAD: dict[str, tuple[tuple[str, bytes], ...]] = {
    "yaml syntax": (("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8\n"),),
    "bad cidr": (("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs:\n  - 10.0.0.1/8\n"),),
    "unknown rule key": (("/etc/config/ip-masq-agent", b"rules:\n  - name: a\n    port: 1\n"),),
    "invalid utf-8": (("/etc/config/ip-masq-agent", b"cidrLimit: \xff\n"),),
    "conflict across files": (("/etc/config/ip-masq-a", b"nonMasqueradeCIDRs: [10.1.0.0/16]\n"),
                              ("/etc/config/ip-masq-b", b"masqueradeCIDRs: [10.1.0.0/16]\n")),
    **{f"hostile {name}": (("/etc/config/ip-masq-agent", data),) for name, (data, _, _) in NESTED.items()},
}


def _same_config(got: MasqConfig, want: MasqConfig) -> None:
    assert got == want
    assert got.warnings == want.warnings  # not part of ==
    for f in dataclasses.fields(MasqConfig):  # tuples stay tuples, enums enums: equal and of the same types
        assert type(getattr(got, f.name)) is type(getattr(want, f.name)), f.name


@pytest.mark.parametrize("case", sorted(GOOD))
def test_the_child_loads_the_config_the_agent_would(case: str) -> None:
    config_input = ConfigInput(GOOD[case])
    want = config_from_bytes(config_input, OPTIONS)
    _same_config(load_config_isolated(config_input, OPTIONS), want)


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_child_refuses_with_the_same_one_line_error(case: str) -> None:
    config_input = ConfigInput(BAD[case])
    with pytest.raises(ConfigError) as in_process:
        config_from_bytes(config_input, OPTIONS)
    with pytest.raises(ConfigError) as isolated:
        load_config_isolated(config_input, OPTIONS)
    want, got = in_process.value, isolated.value
    assert (got.located(), got.source, got.line, got.column, got.code) == (
        want.located(), want.source, want.line, want.column, want.code)
    assert "\n" not in got.located()


def test_the_flags_reach_the_child() -> None:
    # a node-scoped rule needs the node name, --to-ports refuses a rule's own SNAT: both are the flags' doing
    config_input = ConfigInput(GOOD["rules, IPv6, every key"])
    with pytest.raises(ConfigError, match="the node name is unknown"):
        load_config_isolated(config_input, PolicyOptions())
    with pytest.raises(ConfigError, match="with --to-ports is not supported"):
        load_config_isolated(config_input, dataclasses.replace(OPTIONS, to_ports=(PortRange(1024, 2047),)))
    v4_only = ConfigInput((("f", b"nonMasqueradeCIDRs: [10.0.0.0/8]\nenableIPv6: true\n"),))
    options = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True, enable_ipv6=False,
                            random_fully=False)
    _same_config(load_config_isolated(v4_only, options), config_from_bytes(v4_only, options))


def test_every_field_crosses_the_process_boundary() -> None:
    # a field added to the model or the options without the codec learning it fails here, not on a node
    assert set(encode_options(OPTIONS)) == {f.name for f in dataclasses.fields(PolicyOptions)}
    config = config_from_bytes(ConfigInput(GOOD["rules, IPv6, every key"]), OPTIONS)
    encoded = encode_config(config)
    assert set(encoded) - {"strings"} == {f.name for f in dataclasses.fields(MasqConfig)}
    assert set(encoded["rules"][0]) == {f.name for f in dataclasses.fields(Rule)}
    for f in dataclasses.fields(Rule):  # the example sets every rule field, so none falls back to its default
        assert getattr(config.rules[0], f.name) != f.default, f.name
    _same_config(decode_config(encoded), config)


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_child_that_dies_is_one_line_naming_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_input = ConfigInput(GOOD["json"])
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "echo 'Traceback:' >&2; echo 'MemoryError' >&2; "
                                                                   "exit 1"))
    with pytest.raises(IpmasqError, match=r"^config loader process failed \(exit 1\): MemoryError$") as raised:
        load_config_isolated(config_input, OPTIONS)
    assert not isinstance(raised.value, ConfigError)  # not a verdict on the config
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "kill -9 $$"))
    with pytest.raises(IpmasqError, match=r"^config loader process failed \(signal 9\)$"):
        load_config_isolated(config_input, OPTIONS)
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "echo '{\"config\": '"))
    with pytest.raises(IpmasqError, match=r"^config loader process failed \(exit 0\)$"):
        load_config_isolated(config_input, OPTIONS)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "missing"))
    with pytest.raises(IpmasqError, match=r"^config loader process could not start: No such file or directory$"):
        load_config_isolated(config_input, OPTIONS)


def test_the_agent_loads_again_after_the_child_failed() -> None:
    calls: list[str] = []

    def flaky(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
        calls.append("load")
        if len(calls) == 1:
            raise IpmasqError("config loader process failed (signal 9)")
        return config_from_bytes(config_input, options)

    backend = IptablesBackend(FakeIptables(), chain="IP-MASQ-AGENT", variant=Variant.NFT)
    reconciler = Reconciler(backend, OPTIONS, log=logging.getLogger("test.isolated"), load=flaky)
    config_input = ConfigInput(GOOD["json"])
    with pytest.raises(IpmasqError):
        reconciler.observe(config_input)
    report = reconciler.observe(config_input)  # the same bytes: loaded again, not "unchanged"
    assert report.changed and calls == ["load", "load"]
    assert reconciler.policy is not None and reconciler.config_error is None
    assert not reconciler.observe(config_input).changed and len(calls) == 2


def test_sigterm_while_the_child_loads_stops_at_once_and_kills_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "child.pid"
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, f"echo $$ > {pid_file}; exec sleep 30"))
    backend = IptablesBackend(FakeIptables(), chain="IP-MASQ-AGENT", variant=Variant.NFT)
    reconciler = Reconciler(backend, OPTIONS, log=logging.getLogger("test.isolated"), load=load_config_isolated)
    stops: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda number, _: stops.append(number))  # the agent's: request a stop
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    try:
        timer.start()
        with pytest.raises(StopRequested):
            reconciler.observe(ConfigInput(GOOD["json"]))
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert time.monotonic() - started < 5 and stops == [signal.SIGTERM]
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(int(pid_file.read_text()), 0)


AGENT_RUN = """\
import logging
import sys
from ipmasq.cli import build_parser
args = build_parser("agent").parse_args(["agent", f"--backend={sys.argv[1]}"])
from ipmasq.agent.reconcile import Reconciler, StopRequested
from ipmasq.backends.choose import make_backend
from ipmasq.commands.common import options_from_args
from ipmasq.config.isolated import load_config_isolated
from ipmasq.config.source import ConfigInput
from ipmasq.testing import FakeIptables, FakeNft
fake = FakeNft() if sys.argv[1] == "nftables" else FakeIptables()
options = options_from_args(args)
backend, _ = make_backend(sys.argv[1], options, fake, variant="nft")  # the others need tools these fakes lack
reconciler = Reconciler(backend, options, log=logging.getLogger("agent"), load=load_config_isolated)
reconciler.observe(ConfigInput((("/etc/config/ip-masq-agent", sys.argv[2].encode()),)))
assert reconciler.reconcile().readiness.ready
print(" ".join(sorted(sys.modules)))
"""
# What the node agent's process must not hold, each resident for good once imported: the YAML parser and what only
# it pulls in (the loader child has them), the config reader and validator, shlex (an iptables-save line with single
# quotes loads it), ipaddress (IPv6 loads it), anything for HTTP clients or TLS
NOT_IN_THE_AGENT = ("yaml", "_yaml", "ipmasq.config.document", "ipmasq.config.validate", "datetime", "base64",
                    "shlex", "ipaddress", "http", "urllib", "ssl", "email", "prometheus_client", "ipmasq.lint",
                    "ipmasq.diff.diff")


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_the_agent_process_never_imports_the_yaml_parser(backend: str) -> None:
    config = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.1.0.0/16]\n"
    result = subprocess.run([sys.executable, "-c", AGENT_RUN, backend, config], capture_output=True, text=True,
                            check=True)
    modules = set(result.stdout.split())
    assert "ipmasq.config.isolated" in modules and "ipmasq.agent.reconcile" in modules
    held = sorted(m for m in modules if any(m == n or m.startswith(f"{n}.") for n in NOT_IN_THE_AGENT))
    assert held == [], f"the agent's process imports {held}: resident memory it keeps for good"


def test_the_link_local_constant_written_out_is_fe80_10() -> None:
    # written as integers so that importing the model does not load ipaddress; it must be what parsing gives
    from ipmasq.config.model import LINK_LOCAL_V6
    from ipmasq.policy.prefix import parse_cidr

    assert parse_cidr("fe80::/10") == LINK_LOCAL_V6 and str(LINK_LOCAL_V6) == "fe80::/10"
