"""Pure renderers and parsers of the kernel's rule dialects (netfilter's two front ends), apart from the config's
own `rules:` section: what the agent writes and reads, in the exact text the tools take and print.

    iptables   iptables-restore input and iptables-save output: render a policy, parse a dump, canonical rules
    nft        nft scripts and `nft -j` JSON: render a policy's table, parse a listing back
    nft_set    a streaming reader of one large set's elements from `nft -j list set`
    lines      splitting a program's output into lines as str.splitlines does, piece by piece
"""
