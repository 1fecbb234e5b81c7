"""The agent's API features put together and started: the ConfigMaps followed, the reporter of Events and status, and
the candidate for the fleet summary's Lease. One place, used by `ipmasq agent` and by the fleet bench, which runs
this very wiring for each simulated node."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ipmasq import __version__
from ipmasq.agent.apiconfig import ApiConfig
from ipmasq.agent.apireport import ApiReporter, Narrator
from ipmasq.agent.summary import LEASE_SECONDS, SummaryWriter
from ipmasq.kube.agentstatus import StatusWriter
from ipmasq.kube.client import ApiClient
from ipmasq.kube.events import EventRecorder
from ipmasq.kube.lease import LeaseElector

__all__ = ["COMPONENT", "start_api"]

COMPONENT = "ip-masq-agent"  # the source of the agent's Events


def start_api(client: ApiClient, node: str, *, pod: str | None, namespace: str, names: Sequence[str], key: str,
              summary_lease: str, log: logging.Logger, poke: Callable[[], None],
              stop: threading.Event) -> tuple[ApiConfig, ApiReporter]:
    """Start following the ConfigMaps (`poke` wakes the loop on a new content), the reporter (a LoopObserver: the
    loop hands it its reports) and, unless `summary_lease` is empty, the summary writer's candidacy."""
    api_config = ApiConfig(client, namespace, names, key, log=log, poke=poke, stop=stop)

    def configmap_exists() -> bool | None:
        states = api_config.states()
        if len(states) < len(api_config.names):
            return None  # not listed yet: unknown
        return any(state.exists for state in states.values())

    def configmaps() -> tuple[tuple[str, str], ...]:
        return tuple((name, state.resource_version or "") for name, state in sorted(api_config.states().items())
                     if state.exists)

    narrator = Narrator(node, pod=pod, version=__version__, backend="", source=lambda: api_config.source,
                        configmaps=configmaps, configmap_exists=configmap_exists, api_digest=api_config.digest)
    reporter = ApiReporter(narrator, EventRecorder(client, component=COMPONENT, host=node),
                           StatusWriter(client, node), log=log, stop=stop)
    api_config.start()
    reporter.start()
    if summary_lease:
        elector = LeaseElector(client, namespace, summary_lease, node, duration=LEASE_SECONDS)
        SummaryWriter(client, elector, api_config.states, api_config.digest, component=COMPONENT, host=node,
                      log=log, stop=stop).start()
    return api_config, reporter
