"""The agent's API features put together and started: the ConfigMaps followed, the reporter of Events and status, and
the candidate for the fleet summary's Lease. One place, used by `ipmasq agent` and by the fleet bench, which runs
this very wiring for each simulated node."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ipmasq import __version__
from ipmasq.agent.api.config import ApiConfig
from ipmasq.agent.api.report import ApiReporter, FleetSize, Narrator
from ipmasq.agent.api.summary import LEASE_SECONDS, SummaryFacts, SummaryWriter
from ipmasq.kube.agentstatus import StatusWriter
from ipmasq.kube.client import ApiClient
from ipmasq.kube.events import EventRecorder
from ipmasq.kube.lease import LeaseElector
from ipmasq.observe.provider_inputs import WriterInputs
from ipmasq.writers import Writer

__all__ = ["COMPONENT", "start_api"]

COMPONENT = "ip-masq-agent"  # the source of the agent's Events


def start_api(client: ApiClient, node: str, *, pod: str | None, namespace: str, names: Sequence[str], key: str,
              summary_lease: str, log: logging.Logger, poke: Callable[[], None], stop: threading.Event,
              mode: str = "enforce", writer: str | None = None, chain: str = "",
              inputs: Writer | None = None, facts: SummaryFacts | None = None) -> tuple[ApiConfig | WriterInputs,
                                                                                       ApiReporter]:
    """Start following the ConfigMaps (`poke` wakes the loop on a new content), the reporter (a LoopListener: the
    loop hands it its reports) and, unless `summary_lease` is empty, the summary writer's candidacy (woken by each
    new content). `mode` "observe": the status says so, with the `writer` and `chain` observed; `inputs`: that
    writer's own inputs are followed instead of `names` (ipmasq.observe.provider_inputs); `facts`: the agent's metrics,
    told what the summary learns (the node-trust policy, a Lease lost early)."""
    api_config = (ApiConfig(client, namespace, names, key, log=log, poke=poke, stop=stop) if inputs is None
                  else WriterInputs(client, inputs, log=log, poke=poke, stop=stop))
    events = EventRecorder(client, component=COMPONENT, host=node)
    narrator = Narrator(node, pod=pod, version=__version__, backend="", mode=mode, writer=writer, chain=chain)
    fleet = FleetSize()
    reporter = ApiReporter(narrator, events, StatusWriter(client, node), log=log, stop=stop, fleet=fleet)
    if summary_lease:
        elector = LeaseElector(client, namespace, summary_lease, node, duration=LEASE_SECONDS)
        summary = SummaryWriter(client, elector, events, log=log, stop=stop, fleet=fleet, facts=facts)
        api_config.listeners.append(summary.content_changed)
        summary.start()
    api_config.start()
    reporter.start()
    return api_config, reporter
