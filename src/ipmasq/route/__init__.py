"""The node's routing as the kernel decides it, pure: its ip rules, route tables, links and addresses as values
(route/facts.py), read from iproute2's JSON (route/iproute2.py), the routing decision (route/lookup.py) and the
source address MASQUERADE takes (route/address.py). Nothing here touches the kernel: the live read is
ipmasq.diagnose.path_sources, through the Runner; the whole path of a pod's packet is ipmasq.diagnose.path.
"""
