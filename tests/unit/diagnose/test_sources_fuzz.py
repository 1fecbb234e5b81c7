"""Fuzzing the dump readers and the flow-log parsers: any text ends in a result or in the project's own error
(IpmasqError and its subclasses), never in another exception. The iptables-save reader is also followed by the
tracer and check, which must decide or say "cannot decide" on whatever the reader accepted."""

from __future__ import annotations

import contextlib
import gzip
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipmasq.audit import audit, count_flows
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import check_node
from ipmasq.diagnose.sources import rules_from_dump
from ipmasq.diagnose.trace import Tracer
from ipmasq.errors import IpmasqError
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import parse_cidr

OPTIONS = PolicyOptions()
POLICY = Policy(config_from_bytes(ConfigInput((("c", b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"),)), OPTIONS), OPTIONS)

# pieces of real rules, so that the fuzzer reaches deep into the reader and the tracer, not only the first check
TOKENS = ["-A", "POSTROUTING", "IP-MASQ-AGENT", "X", "-j", "-g", "RETURN", "MASQUERADE", "SNAT", "ACCEPT", "MARK",
          "--to-source", "10.0.0.1", "-d", "-s", "!", "10.0.0.0/8", "fd00::/8", "-p", "tcp", "-m", "comment",
          "--comment", '"ip-masq-agent: x"', "addrtype", "--dst-type", "LOCAL", "mark", "--mark", "0x1/0x1",
          "--set-xmark", "0x4000/0x0", "-o", "eth0+", "multiport", "--dports", "80,443", "[1:2]", '"', "'", "\\"]
LINES = st.one_of(
    st.lists(st.sampled_from(TOKENS), min_size=1, max_size=10).map(" ".join),
    st.sampled_from([":POSTROUTING ACCEPT [0:0]", ":X - [0:0]", ":IP-MASQ-AGENT - [0:0]", "*nat", "*filter",
                     "COMMIT", "# comment", ""]),
    st.text(max_size=40),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINES, max_size=25))
def test_any_iptables_save_text_reads_traces_and_checks_or_raises_our_error(lines: list[str]) -> None:
    text = "*nat\n" + "\n".join(lines) + "\nCOMMIT\n"
    try:
        rules = rules_from_dump(text, "dump")
    except IpmasqError:
        return
    for table in rules.tables.values():
        tracer = Tracer(table)
        for destination in ("10.1.2.3", "8.8.8.8"):
            tracer.trace(Packet.of(destination, source="10.44.0.1"))
            tracer.trace(Packet.of(destination, source="10.44.0.1"), record_steps=False)
    check_node(POLICY, rules, pod_ranges=(parse_cidr("10.44.0.0/14"),))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_as_a_dump_is_a_result_or_our_error(text: str) -> None:
    with contextlib.suppress(IpmasqError):
        check_node(POLICY, rules_from_dump(text, "dump"))


AWS_WORDS = ["2", "123456789010", "eni-1", "10.44.14.15", "172.30.12.110", "-", "443", "6", "20", "4249",
             "1418530010", "ACCEPT", "REJECT", "OK", "NODATA", "version", "srcaddr", "dstaddr", "action", "x", "5"]
GCP_LINES = st.one_of(
    st.fixed_dictionaries({"connection": st.fixed_dictionaries({
        "src_ip": st.one_of(st.sampled_from(["10.44.0.1", "8.8.8.8", "", "::1"]), st.integers(), st.none()),
        "dest_ip": st.one_of(st.sampled_from(["172.30.12.110", "x"]), st.integers(), st.lists(st.integers()))}),
        "disposition": st.one_of(st.sampled_from(["ALLOWED", "DENIED", "?"]), st.integers())}).map(str),
    st.text(max_size=60),
)


def _count(body: bytes, *, compress: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "flows")
        path.write_bytes(gzip.compress(body) if compress else body)
        with contextlib.suppress(IpmasqError):
            audit(count_flows([str(path)], (parse_cidr("10.44.0.0/14"),)), POLICY)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(AWS_WORDS), max_size=16).map(" ".join), max_size=8), st.booleans())
def test_any_aws_flow_log_is_a_result_or_our_error(lines: list[str], compress: bool) -> None:
    _count("\n".join(lines).encode(), compress=compress)


@settings(max_examples=300, deadline=None)
@given(st.lists(GCP_LINES, max_size=6), st.booleans(), st.binary(max_size=20))
def test_any_gcp_flow_log_is_a_result_or_our_error(lines: list[str], compress: bool, tail: bytes) -> None:
    body = "\n".join('{"x": 1}' if not line.startswith("{") else line.replace("'", '"').replace("None", "null")
                     for line in lines).encode() + tail
    _count(b"{" + body if body and not body.startswith(b"{") else body, compress=compress)
