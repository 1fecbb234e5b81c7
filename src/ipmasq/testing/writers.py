"""The rules the providers' own agents write, as their sources write them (never ipmasq's renderer): what tests and
the lab's stand-in writer put into a kernel (iptables-restore text) to play a provider's agent beside ipmasq."""

from __future__ import annotations

__all__ = ["MASQ_COMMENT", "NON_MASQ_COMMENT", "aws_snat_rules", "ip_masq_agent_rules"]

NON_MASQ_COMMENT = '-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE"'
MASQ_COMMENT = ('-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in '
                'chain)"')


def ip_masq_agent_rules(chain: str, cidrs: tuple[str, ...], *, random_fully: bool) -> str:
    """What the reference agent (and GKE's, and AKS's v2) writes: kubernetes-sigs/ip-masq-agent syncMasqRules (the
    link-local range first, as it always adds it, then `cidrs`)."""
    jump = (f'-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL '
            f'destination traffic to our custom {chain} chain" -m addrtype ! --dst-type LOCAL -j {chain}\n')
    body = "".join(f"-A {chain} {NON_MASQ_COMMENT} -d {cidr} -j RETURN\n" for cidr in ("169.254.0.0/16", *cidrs))
    return (f"*nat\n:{chain} - [0:0]\n{jump}{body}-A {chain} {MASQ_COMMENT} -j MASQUERADE"
            f"{' --random-fully' if random_fully else ''}\nCOMMIT\n")


def aws_snat_rules(vpc: str, exclusions: tuple[str, ...], primary: str) -> str:
    """What the VPC CNI writes: aws/amazon-vpc-cni-k8s pkg/networkutils/network.go buildIptablesSNATRules (the
    excluded CIDRs, the VPC's, then SNAT to the node's primary address)."""
    returns = "".join(f'-A AWS-SNAT-CHAIN-0 -d {cidr} -m comment --comment "AWS SNAT CHAIN EXCLUSION" -j RETURN\n'
                      for cidr in exclusions)
    return ("*nat\n:AWS-SNAT-CHAIN-0 - [0:0]\n"
            '-A POSTROUTING -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-0\n'
            f"{returns}"
            f'-A AWS-SNAT-CHAIN-0 -d {vpc} -m comment --comment "AWS SNAT CHAIN" -j RETURN\n'
            '-A AWS-SNAT-CHAIN-0 ! -o vlan+ -m comment --comment "AWS, SNAT" -m addrtype ! --dst-type LOCAL '
            f"-j SNAT --to-source {primary} --random-fully\nCOMMIT\n")
