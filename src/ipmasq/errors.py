"""Every error ipmasq raises, in one tree, translated at the seam where it happens.

    IpmasqError                 anything ipmasq reports to an operator (one line, no traceback)
    ├── ConfigError             a config file or flag value is wrong; names file, line and offending value
    │   ├── InputUnreadable     an input could not be read at all (missing, unreadable, not a regular file)
    │   └── InputsPending       the API's objects a config is made of are not all listed yet (observe mode)
    ├── UsageError              the command line is wrong (exit 2)
    ├── BackendError            a kernel tool failed; carries the tool's argv and stderr
    │   └── LockBusyError       the xtables lock is held by someone else (retry later)
    ├── RuleParseError          a line of iptables-save/restore text that cannot be read (netfilter.iptables)
    ├── NftParseError           nft output or an nft script that is not what we expect (netfilter.nft)
    ├── NftTraceError           an nft JSON listing `trace`/`check` cannot read at all (diagnose.trace_nft)
    ├── RouteDumpError          iproute2 JSON that ip -j rule/route/addr do not print (ipmasq.route.iproute2)
    ├── FlowLogError            a flow log line of no format `audit` reads; names the file and line (audit)
    ├── NotANode                a live `check` found no nat rule at all: nothing there to compare (exit 3)
    ├── WorkBudgetExhausted     a check spent its work budget (ipmasq.policy.budget); its caller says what is left
    ├── PluginError             kubectl could not be run, or said no (kubectl ipmasq)
    ├── Abandoned               whoever asked for the work is gone (a webhook client that closed its connection)
    ├── ReviewError             a body that is not an AdmissionReview request: HTTP 400, never a verdict (webhook)
    ├── CertificateError        a Secret holds no usable certificate set (webhook)
    ├── WebhookServerError      the webhook cannot serve: the address is taken, the certificate is unusable
    ├── LabError                the lab could not bring the world into the state a step needs (ipmasq.lab)
    │   ├── NetnsError          an `ip` command or a probe in the lab's network namespaces failed
    │   ├── FleetError          the fleet lab did not reach a step's state within its deadline
    │   ├── PrometheusError     the lab's Prometheus did not start, or its API did not answer as documented
    │   ├── ClusterError        the Kubernetes lab could not bring its cluster into the state asked for
    │   └── BuildError          an artifact of the Kubernetes lab could not be built or found
    └── ApiError                the API server could not be asked, or refused (ipmasq.kube)
        ├── ApiUnreachable      no answer: connection refused or reset, TLS failure, timeout, a garbled reply
        │   └── ApiMalformed    an answer that is not what the API sends: an object of the wrong shape, a list
        │                       past its bound in pages or bytes
        └── ApiRefused          an answer with an error status; its `status`, the server's message and its Status
            ├── ApiClientError  4xx (and a 3xx, never followed): this request is wrong; asking again will not help
            │   ├── Unauthorized    401: the token is not (or no longer) valid
            │   ├── Forbidden       403: RBAC does not allow it
            │   ├── NotFound        404
            │   ├── Conflict        409: exists already, or changed since it was read
            │   └── Gone            410: a watch's resourceVersion is too old; list again
            ├── TooManyRequests 429: the server sheds load (API Priority and Fairness); ask again after retry_after
            └── ApiServerError  5xx: the server failed; ask again later (retry_after when it said when)
    PrefixError (ValueError)    a CIDR that does not parse or is not aligned; callers locate it as a ConfigError
    InputRefused                a file that is not read (input_files); callers name the path and what it was for
    ├── NotAFile                a device, socket or directory (or, where a regular file is asked for, a FIFO)
    ├── NoWriter                a FIFO that no process holds open for writing
    ├── FileTooLarge            more bytes than the reader's bound (nothing past it was kept)
    └── FileTooSlow             not read within the reader's deadline
    HttpError                   an HTTP exchange failed (ipmasq.http11); each caller translates it at its seam
    ├── HttpTimeout             the exchange's deadline passed
    └── TooLarge                a body or a line over its bound (nothing past the bound was kept)
    Undecidable                 a rule `trace` cannot evaluate for a packet (diagnose.trace, trace_nft): the trace's
                                outcome says why; never reported as an error
    StopRequested (BaseException)  SIGTERM or SIGINT during a config's parse (agent.reconcile, agent.loop): stop now

Two exceptions stay private to their module, as control flow that never leaves it: config.rules._Said (a field
whose problems are reported already) and netfilter.nft_json._Unrecognised (a JSON expression with no text form: the
rule is shown as unrecognised). tests/unit/test_structure.py holds every other exception class to this module.

The CLI (ipmasq.cli.Exit) maps ConfigError to exit 1 (the input was read and is wrong), UsageError to exit 2, and
InputUnreadable and every other IpmasqError to exit 3 (could not run); each is one line, ``ipmasq COMMAND: <message>``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Abandoned",
    "ApiClientError",
    "ApiError",
    "ApiMalformed",
    "ApiRefused",
    "ApiServerError",
    "ApiUnreachable",
    "BackendError",
    "BuildError",
    "CertificateError",
    "ClusterError",
    "ConfigError",
    "Conflict",
    "FileTooLarge",
    "FileTooSlow",
    "FleetError",
    "FlowLogError",
    "Forbidden",
    "Gone",
    "HttpError",
    "HttpTimeout",
    "InputRefused",
    "InputUnreadable",
    "IpmasqError",
    "LabError",
    "LockBusyError",
    "NetnsError",
    "NftParseError",
    "NftTraceError",
    "NoWriter",
    "NotAFile",
    "NotFound",
    "PacketDropped",
    "PluginError",
    "PrefixError",
    "PrometheusError",
    "ReviewError",
    "RouteDumpError",
    "RuleParseError",
    "StopRequested",
    "TooLarge",
    "TooManyRequests",
    "Unauthorized",
    "Undecidable",
    "UsageError",
    "WebhookServerError",
    "WorkBudgetExhausted",
    "clip",
    "one_line",
]

# How much of an offending value a one-line error quotes: enough to recognise it, never a 10 MB line.
CLIP_CHARS = 60


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text` cut to `limit` characters with an ellipsis: what an error line may echo of a value."""
    return text if len(text) <= limit else text[:limit] + "\u2026"


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline, a tab, a NUL, an escape) written as its Python
    escape: an error quotes values from hostile files, and an error is one line a terminal shows as it is."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


class IpmasqError(Exception):
    """Base of every error ipmasq reports to a person."""


class ConfigError(IpmasqError):
    """A configuration problem, located as precisely as we can: ``file:line: message``."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 column: int | None = None, code: str | None = None) -> None:
        self.message = message
        self.source = source
        self.line = line
        self.column = column  # 1-based, where known; `lint` reports it
        self.code = code  # a lint finding id ("invalid-cidr", ...) so that lint classifies without parsing text
        super().__init__(self.located())

    def located(self) -> str:
        where = ""
        if self.source is not None:
            where = self.source if self.line is None else f"{self.source}:{self.line}"
            where += ": "
        return one_line(f"{where}{self.message}")


class InputUnreadable(ConfigError):
    """An input could not be read at all (missing, no permission, a directory or device, a listing that failed):
    nothing can be said about its content. A ConfigError, so the agent keeps its last good rules as for any other."""


class InputsPending(ConfigError):
    """The objects a config is composed of (a provider's ConfigMaps, the aws-node DaemonSet) are not all listed
    through the API yet: no verdict on any config, only why there is none yet. Observe mode loads nothing while it
    lasts (ipmasq.observe.provider_inputs hands it to the loop in the content's place)."""


class WorkBudgetExhausted(IpmasqError):
    """A check spent the work it was given (ipmasq.policy.budget) before it finished: its caller says what it did
    not check."""


class PluginError(IpmasqError):
    """kubectl could not be run, or said no: `kubectl ipmasq` could not run (exit 3)."""


class WorkOutgrown(IpmasqError):
    """A check did more work than where it runs allows (ipmasq.policy.budget's handoff: the webhook's event-loop
    process decides only small reviews): its caller runs it again, whole, where the large ones run."""


class Abandoned(IpmasqError):
    """Work stopped because whoever asked for it is gone (a webhook client that closed its connection)."""


class ReviewError(IpmasqError):
    """The body is not an AdmissionReview request: answered with HTTP 400, never with a verdict."""


class CertificateError(IpmasqError):
    """A Secret holds no usable certificate set (missing keys, not PEM, a key that does not match)."""


class WebhookServerError(IpmasqError):
    """The webhook cannot serve (the address is taken, the certificate is unusable)."""


class DecisionFault(IpmasqError):
    """A review's decision failed in the webhook's decision process, or that process ended: answered with 500."""


class LabError(IpmasqError):
    """The lab could not bring the world into the state a phase needs."""


class NetnsError(LabError):
    """An `ip` command that sets up the lab failed, or a probe in the lab's namespaces did."""


class FleetError(LabError):
    """The fleet lab could not reach the state a step needs within its deadline."""


class PrometheusError(LabError):
    """The lab's Prometheus did not start, or its API did not answer as documented."""


class ClusterError(LabError):
    """The Kubernetes lab could not bring the cluster into the state asked for."""


class BuildError(LabError):
    """An artifact of the Kubernetes lab could not be built or found."""


class UsageError(IpmasqError):
    """The command line itself is wrong."""


class BackendError(IpmasqError):
    """A kernel tool (iptables-restore, nft, ...) failed; its stderr is part of the message."""

    def __init__(self, message: str, *, argv: tuple[str, ...] = (), stderr: str = "", returncode: int | None = None):
        self.argv = argv
        self.stderr = stderr
        self.returncode = returncode
        detail = stderr.strip().replace("\n", " | ")
        super().__init__(f"{message}: {detail}" if detail else message)


class LockBusyError(BackendError):
    """Another process holds the xtables lock; the caller should back off and retry."""


class RuleParseError(IpmasqError):
    """A line of iptables-save/restore text we cannot read."""


class NftParseError(IpmasqError):
    """nft output or an nft script that is not what we expect."""


class NftTraceError(IpmasqError):
    """An nft JSON listing trace cannot read at all (one line: what and where)."""


class RouteDumpError(IpmasqError):
    """iproute2 JSON (ip -j rule, route, addr) that is not what those commands print; names the input."""


class FlowLogError(IpmasqError):
    """A flow log line that is neither of the formats we read; names the file and line."""


class NotANode(IpmasqError):
    """A live `check` read no nat rule at all (iptables or nftables): not a node whose pod SNAT is nat rules."""


class ApiError(IpmasqError):
    """The API server could not be asked, or refused; the agent keeps enforcing what it has and asks again later."""


class ApiUnreachable(ApiError):
    """No usable answer from the API server (refused, reset, TLS, timeout, a reply that is not the API's)."""


class ApiMalformed(ApiUnreachable):
    """An answer that is not what the API server sends: a field of the wrong type, an object without its name, a
    list that never ends; one line naming the call and the field, never a traceback in the caller."""


class ApiRefused(ApiError):
    """The API server answered with an error status; `status_object` is the API's Status when it sent one."""

    def __init__(self, status: int, message: str, *, verb: str = "", path: str = "",
                 status_object: dict[str, Any] | None = None, retry_after: float | None = None) -> None:
        self.status = status
        self.server_message = message
        self.status_object = status_object
        self.retry_after = retry_after  # seconds the server asked us to wait (Retry-After), when it said
        where = f"{verb} {path}: " if verb else ""
        super().__init__(one_line(f"{where}{status} {clip(message, 200)}"))

    @property
    def reason(self) -> str | None:
        """The Status's machine-readable reason (NotFound, AlreadyExists, Expired, TooManyRequests, ...)."""
        reason = (self.status_object or {}).get("reason")
        return reason if isinstance(reason, str) else None


class ApiClientError(ApiRefused):
    """4xx, or a 3xx (a redirect is never followed with the token): the request itself is refused."""


class Unauthorized(ApiClientError):
    """401: the credentials are not (or no longer) valid."""


class Forbidden(ApiClientError):
    """403: RBAC does not allow this request."""


class NotFound(ApiClientError):
    """404: no such object."""


class Conflict(ApiClientError):
    """409: the object exists already, or changed since it was read."""


class Gone(ApiClientError):
    """410: the resourceVersion a watch started from is too old; list again."""


class TooManyRequests(ApiRefused):
    """429: the server sheds load; the request was not carried out and may be sent again after `retry_after`."""


class ApiServerError(ApiRefused):
    """5xx: the server (or a proxy before it) failed; asking again later may work."""


class PrefixError(ValueError):
    """A CIDR that does not parse or is not aligned; the message is the reference agent's."""


class InputRefused(Exception):
    """A file that is not read (ipmasq.input_files): its message says what it is or what bound it passed, and the
    caller names the path."""


class NotAFile(InputRefused):
    """The path is a device, socket or directory (or a FIFO where a regular file is asked for): what it is, as
    "a socket"."""


class NoWriter(InputRefused):
    """The path is a FIFO that no process holds open for writing: reading it would be an empty file or a wait."""


class FileTooLarge(InputRefused):
    """The file holds more than the reader's bound; nothing past the bound was kept."""


class FileTooSlow(InputRefused):
    """The file was not read within the reader's deadline (a network or FUSE file system that stalls)."""


class HttpError(Exception):
    """An HTTP exchange failed: the connection, TLS, or an answer that is not HTTP/1.1 (the message says which)."""


class HttpTimeout(HttpError):
    """The exchange's deadline passed."""


class TooLarge(HttpError):
    """A body or a line over its bound (nothing past the bound was kept)."""


class Undecidable(Exception):
    """A rule the tracer cannot evaluate for this packet; the message says why. Not an IpmasqError: the trace's
    outcome carries it (the rule, and why), it is never reported as a failure."""


class PacketDropped(Exception):
    """A rule or route that drops the packet on the node; the message names it. Not an IpmasqError: the path's
    answer carries it (no destination sees the packet), it is never reported as a failure."""


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived while a config was being parsed: the process stops now instead of after the parse
    (seconds for 100,000 CIDRs). Nothing was written: the kernel keeps the rules it had. A BaseException, so that
    the loop's catch-all for unexpected errors lets it through."""
