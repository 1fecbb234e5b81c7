"""The keys a writer ignores: `ignored(writer, files, writes)` names each key of its config that it does not read
(ipmasq's extensions; AKS's merger and Cilium also drop cidrLimit and resyncInterval) and what happens to the
traffic that key names ("10.11.0.0/24 stays un-masqueraded"): check's, lint's and observe mode's ignored-by-writer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ipmasq.config.document import Document, Field, parse_document
from ipmasq.config.model import (
    DEFAULT_CIDR_LIMIT,
    DEFAULT_RESYNC_SECONDS,
    LINK_LOCAL_V4,
    LINK_LOCAL_V6,
    MasqConfig,
    Rule,
)
from ipmasq.config.validate import KNOWN_KEYS, merge_settings, settings_from_document
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import Span, subtract, to_prefixes, union_of_prefixes
from ipmasq.prefix import Family, Prefix
from ipmasq.writers.profiles import (
    AKS_CONFIGMAPS,
    AKS_FRAGMENT_PREFIX,
    REFERENCE_CONFIGMAP,
    REFERENCE_KEY,
    WRITERS,
    Sources,
    Writer,
    configmap_source,
)

__all__ = ["Ignored", "config_files", "ignored"]


@dataclass(frozen=True, slots=True)
class Ignored:
    """A key of a config a writer reads that the writer itself ignores (ipmasq's extensions: masqueradeCIDRs, rules,
    enableIPv6; AKS's merger and Cilium also drop cidrLimit and resyncInterval; the VPC CNI reads no config at all),
    and what that does to pod traffic, in words: "10.11.0.0/24 stays un-masqueraded"."""

    writer: str  # the profile's name
    key: str  # the documented spelling
    source: str  # the file (configmap/NAME[KEY], or the file linted)
    line: int | None
    effect: str  # what happens instead, one clause or several joined by "; "
    # the destinations whose pod traffic is treated otherwise than the key says (empty: nothing changes)
    changed: tuple[str, ...] = ()

    @property
    def changes_traffic(self) -> bool:
        return bool(self.changed)

    def where(self) -> str:
        return self.source if self.line is None else f"{self.source}:{self.line}"

    def message(self, *, located: bool = True) -> str:
        """"GKE's managed agent ignores masqueradeCIDRs (configmap/ip-masq-agent[config]:4): 10.11.0.0/24 stays
        un-masqueraded; enforce with ipmasq to use it"."""
        writer = WRITERS.get(self.writer)
        called = writer.called if writer is not None and writer.called else self.writer
        at = f" ({self.where()})" if located else ""
        tail = "; enforce with ipmasq to use it" if self.changed else ""
        return f"{called[:1].upper()}{called[1:]} ignores {self.key}{at}: {self.effect}{tail}"

    def hint(self) -> str:
        """How to act on it: enforce with ipmasq in the writer's place, or delete the key."""
        delete = "delete the key, so that the config says what the node does"
        if self.writer == "eks":
            return ("the VPC CNI reads aws-node's AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS, not this ConfigMap: list the "
                    "ranges there, or set AWS_VPC_K8S_CNI_EXTERNALSNAT=true and enforce with ipmasq; otherwise "
                    + delete)
        if not self.changed:
            return delete
        return ("to have it enforced, run ipmasq in that agent's place (docs/how-to/migrate-from-ip-masq-agent.md); "
                "otherwise " + delete)


# how many destinations an effect names before "and N more" (Ignored.changed has them all)
_NAMED = 6


def config_files(writer: Writer, sources: Sources) -> tuple[tuple[str, bytes], ...]:
    """The config files among a writer's inputs whose keys ipmasq would read (configmap/NAME[KEY], bytes): the
    ip-masq-agent ConfigMap's `config` (which the VPC CNI does not read at all), AKS's ip-masq fragments."""
    if writer.name == "aks":
        return tuple(sorted((configmap_source(name, key), data) for name in AKS_CONFIGMAPS
                            for key, data in sources.configmaps.get(name, {}).items()
                            if key.startswith(AKS_FRAGMENT_PREFIX)))
    data = sources.configmaps.get(REFERENCE_CONFIGMAP, {}).get(REFERENCE_KEY)
    return () if data is None else ((configmap_source(REFERENCE_CONFIGMAP, REFERENCE_KEY), data),)


def ignored(writer: Writer, files: Sequence[tuple[str, bytes]], writes: MasqConfig | ConfigError,
            options: PolicyOptions | None = None) -> tuple[Ignored, ...]:
    """Every key of `files` that `writer` does not read (ipmasq reads it), with what that does to pod traffic:
    ipmasq's reading of the key against `writes`, the config the writer enforces (intended), or the error for which
    it enforces none. `options`: the writer's flags (default: its profile's)."""
    options = options or writer.options
    out: list[Ignored] = []
    if isinstance(writes, MasqConfig):
        preserved = Policy(writes, options if writer.name != "cilium" else PolicyOptions())
    else:
        preserved = None
    for where, data in files:
        try:
            doc = parse_document(data, where)
        except ConfigError:
            continue  # not a config: the writer's own error says so
        if doc is None:
            continue
        fields: dict[str, Field] = {}
        for f in doc.fields:
            canonical = KNOWN_KEYS.get(f.key.lower())
            if canonical is not None and canonical not in writer.keys and f.value.value is not None:
                fields[canonical] = f  # the last one wins, as everywhere
        if not fields:
            continue
        ours = _ipmasq_reading(doc, options)
        for key, f in fields.items():
            effect, changed = _effect(writer, key, ours, preserved, writes, options)
            out.append(Ignored(writer.name, key, where, f.line, effect, changed))
    return tuple(out)


def _ipmasq_reading(doc: Document, options: PolicyOptions) -> MasqConfig | None:
    """The file as ipmasq reads it, the node's rules aside (rules for other nodes kept: each is said); None when
    ipmasq refuses it too (lint and the agent say why)."""
    try:
        settings = settings_from_document(doc, enable_ipv6=True)
        return merge_settings([settings], all_reserved=options.nomasq_all_reserved_ranges, enable_ipv6=None)
    except ConfigError:
        return None


def _named(prefixes: Sequence[str]) -> str:
    shown = ", ".join(prefixes[:_NAMED])
    return shown + (f" and {len(prefixes) - _NAMED} more" if len(prefixes) > _NAMED else "")


def _spans_prefixes(family: Family, spans: Sequence[Span]) -> list[str]:
    return [str(p) for first, last in spans for p in to_prefixes(family, first, last)]


def _inside(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    return subtract(a, subtract(a, b))


def _outcomes(dests: Sequence[Prefix], want: str, preserved: Policy, snat_to: str | None = None
              ) -> tuple[list[str], list[str]]:
    """What the writer does to pod traffic to `dests` where the key said `want` ("masquerade", "preserve",
    "snat"): (clauses, the destinations treated otherwise)."""
    clauses: list[str] = []
    changed: list[str] = []
    for family in Family:
        mine = union_of_prefixes([p for p in dests if p.family is family], family.bits)
        if not mine:
            continue
        kept = _inside(mine, preserved.preserved_ranges(family))
        masqueraded = subtract(mine, kept)
        kept_text, masq_text = _spans_prefixes(family, kept), _spans_prefixes(family, masqueraded)
        if want == "preserve":
            if masq_text:
                clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded")
                changed += masq_text
            if kept_text:
                clauses.append(f"{_named(kept_text)} {'keeps' if len(kept_text) == 1 else 'keep'} the pod's "
                               "address anyway (nothing lost)")
            continue
        if kept_text:
            clauses.append(f"{_named(kept_text)} {'stays' if len(kept_text) == 1 else 'stay'} un-masqueraded")
            changed += kept_text
        if masq_text and want == "snat":
            clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded to the "
                           f"node's address, not {snat_to}")
            changed += masq_text
        elif masq_text:
            clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded anyway "
                           "(nothing lost)")
    return clauses, changed


def _rule_traffic(rule: Rule) -> str:
    """A rule's traffic in words: "rule db (preserve, tcp port 5432 from 10.8.0.0/16)"."""
    words = [rule.action.value + (f" to {rule.snat_to}," if rule.snat_to else ",")]
    if rule.protocol:
        words.append(rule.protocol)
    if rule.ports:
        words.append("port" + ("s " if len(rule.ports) > 1 or rule.ports[0][0] != rule.ports[0][1] else " ")
                     + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in rule.ports))
    if rule.sources:
        words.append("from " + _named([str(p) for p in rule.sources]))
    if rule.nodes:
        words.append("on nodes " + ",".join(rule.nodes))
    if len(words) == 1:
        words.append("any traffic")
    return f"rule {rule.name} ({' '.join(words)})"


_NOT_READ = {"cidrLimit": "its limit", "resyncInterval": "its resync"}


def _effect(writer: Writer, key: str, ours: MasqConfig | None, preserved: Policy | None,
            writes: MasqConfig | ConfigError, options: PolicyOptions) -> tuple[str, tuple[str, ...]]:
    if key == "enableIPv6" and isinstance(writes, ConfigError) and writes.code == "ipv6-disabled":
        return (f"IPv6 stays off for it, so it refuses the whole config ({writes.message}) and keeps its last good "
                "rules", ("::/0",))
    if preserved is None:
        return "it does not read it (it refuses these inputs anyway: see its error)", ()
    if key == "cidrLimit":
        if writer.name == "aks":
            return f"ip-masq-agent-v2 keeps its limit of {DEFAULT_CIDR_LIMIT} CIDRs (no traffic changes)", ()
        return "it has no CIDR limit (no traffic changes)", ()
    if key == "resyncInterval":
        if writer.name == "aks":
            return (f"ip-masq-agent-v2 re-applies its rules every {int(DEFAULT_RESYNC_SECONDS)} s (no traffic "
                    "changes)"), ()
        if writer.name == "cilium":
            return "Cilium follows the file as it changes and has no resync (no traffic changes)", ()
        return "it has no such setting (no traffic changes)", ()
    if ours is None:
        return "ipmasq refuses the file as well (lint it); what the key says is not known", ()
    clauses: list[str] = []
    changed: list[str] = []

    def add(found: tuple[list[str], list[str]], prefix: str = "") -> None:
        texts, moved = found
        if texts:
            clauses.append(prefix + ", ".join(texts))
        changed.extend(moved)

    if key == "masqueradeCIDRs":
        add(_outcomes([e.prefix for e in ours.masquerade], "masquerade", preserved))
    elif key == "nonMasqueradeCIDRs":
        add(_outcomes([e.prefix for e in ours.non_masquerade], "preserve", preserved))
    elif key in ("masqLinkLocal", "masqLinkLocalIPv6"):
        v4 = key == "masqLinkLocal"
        on = ours.masq_link_local if v4 else ours.masq_link_local_ipv6
        add(_outcomes([LINK_LOCAL_V4 if v4 else LINK_LOCAL_V6], "masquerade" if on else "preserve", preserved))
    elif key == "enableIPv6":
        if not ours.enable_ipv6:
            return "IPv6 stays off, as the key says (no traffic changes)", ()
        if Family.V6 not in preserved.families:
            return ("it writes no IPv6 rules (only its --enable-ipv6 flag would): IPv6 pod traffic stays "
                    "un-masqueraded everywhere"), ("::/0",)
        return "it manages IPv6 by its own flag (no traffic changes)", ()
    elif key == "rules":
        for number, rule in enumerate(ours.rules):
            texts, moved = _outcomes(list(rule.destinations), rule.action.value, preserved, rule.snat_to)
            if texts and number < _NAMED:
                clauses.append(f"{_rule_traffic(rule)}: " + ", ".join(texts))
            changed.extend(moved)
        if len(ours.rules) > _NAMED:
            clauses.append(f"and {len(ours.rules) - _NAMED} more rules")
    if not clauses:
        return "it lists nothing (no traffic changes)", ()
    return "; ".join(clauses), tuple(dict.fromkeys(changed))
