"""Node diagnosis: the node's real nat rules (a dump or the live node) against the intent.

    sources   where the rules come from: dump files, stdin, or the live node (read-only, through the Runner)
    trace     one packet through the whole nat POSTROUTING, rule by rule; "cannot decide" rather than guess
    check     the config against the rules, as findings with fix hints (structural pass, then traced pass)
"""
