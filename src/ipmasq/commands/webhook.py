"""`ipmasq webhook`: a validating admission webhook for the ip-masq-agent ConfigMap (AdmissionReview v1 over TLS).

Denies what the agent would refuse and what `ipmasq lint` finds cannot be what its author meant, with the line to
fix; admits with warnings (kubectl prints them) what lint warns about, and ConfigMaps that look meant for the agent
but that it never reads. Give it the agent's policy flags, so that it decides as the agent does.

The serving certificate: by default the webhook makes it, shares it with its other replicas through a Secret, renews
it before it expires and keeps the ValidatingWebhookConfiguration's caBundle trusting it (in a pod: the service
account needs get/create/update on that Secret and get/patch on that configuration). With --tls-cert-file and
--tls-key-file (cert-manager's Secret, mounted) it serves those files, re-read when they change, and touches no API.
Needs the `webhook` extra (pip install 'ipmasq[webhook]'), which the image has.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

from ipmasq.commands import common
from ipmasq.errors import UsageError

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser = common.command_parser(subparsers, __doc__)
    parser.add_argument("--listen", default="0.0.0.0:8443", metavar="HOST:PORT",
                        help="where to serve HTTPS: POST /validate, GET /healthz (default %(default)s)")
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "kube-system"), metavar="NAME",
                        help="the webhook's namespace, its Service's and its Secret's (default: $POD_NAMESPACE, "
                        "else kube-system)")
    parser.add_argument("--service", default="ipmasq-webhook", metavar="NAME",
                        help="the Service the API server calls; the certificate names it (default %(default)s)")
    parser.add_argument("--secret", default="ipmasq-webhook-certificate", metavar="NAME",
                        help="the Secret the replicas share the certificate in (default %(default)s)")
    parser.add_argument("--configuration", default="ipmasq-webhook", metavar="NAME",
                        help="the ValidatingWebhookConfiguration whose caBundle is kept (default %(default)s)")
    parser.add_argument("--certificate-days", type=float, default=365.0, metavar="DAYS",
                        help="validity of a certificate it makes; renewed with a third of it left (default "
                        "%(default)s)")
    parser.add_argument("--certificate-check", type=float, default=60.0, metavar="SECONDS",
                        help="how often to read the Secret (renewal, another replica's renewal) (default %(default)s)")
    parser.add_argument("--tls-cert-file", metavar="PATH", help="serve this certificate (cert-manager) instead")
    parser.add_argument("--tls-key-file", metavar="PATH", help="... and this key")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="ordinary (small) decisions at once; more wait their turn, and large ones are decided one "
                             "at a time in a process of their own (default %(default)s: bounded memory)")
    common.add_policy_flags(parser, config_help=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ipmasq.webhook.keeper import KeeperSettings
        from ipmasq.webhook.process import WebhookProcess, WebhookSettings
    except ImportError as exc:  # the extra is not installed
        raise UsageError(f"needs the webhook extra (pip install 'ipmasq[webhook]'): {exc}") from None
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise UsageError("--tls-cert-file and --tls-key-file go together")
    if args.certificate_days <= 0 or args.certificate_check <= 0 or args.workers < 1:
        raise UsageError("--certificate-days, --certificate-check and --workers must be above zero")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen: {args.listen!r} is not HOST:PORT")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # a failure to serve (the API server, the certificate's Secret) is ipmasq.cli's "could not run" (exit 3)
    keeper = KeeperSettings(namespace=args.namespace, service=args.service, secret=args.secret,
                            configuration=args.configuration, days=args.certificate_days)
    settings = WebhookSettings(address=(host.strip("[]"), int(port)), options=common.options_from_args(args),
                               keeper=keeper, workers=args.workers, certificate_check=args.certificate_check,
                               tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file)
    WebhookProcess(settings).run(stop)
    return 0
