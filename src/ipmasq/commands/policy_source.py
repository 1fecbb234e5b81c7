"""Where the offline tools (render, explain, check, audit, diff) take their policy from: the policy flags and
--config, which may also be the ConfigMap manifest an operator is about to apply. The agent reads only what the
kubelet mounts (ipmasq.config.source), so it does not import the manifest reader this needs."""

from __future__ import annotations

import argparse
import sys

from ipmasq.commands.common import options_from_args
from ipmasq.config.model import MasqConfig
from ipmasq.config.source import ConfigInput, config_from_bytes, load_config, read_config_input
from ipmasq.errors import ConfigError
from ipmasq.lint.manifest import configmap_config
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy

__all__ = ["load_config_or_manifest", "load_policy", "load_policy_config", "print_config_warnings"]


def load_policy(args: argparse.Namespace, command: str) -> Policy:
    """The policy of the policy flags and --config, the config's warnings said on stderr as `ipmasq COMMAND: ...`."""
    options = options_from_args(args)
    config = load_policy_config(args, options)
    print_config_warnings(command, config)
    return Policy(config, options)


def print_config_warnings(command: str, config: MasqConfig) -> None:
    for warning in config.warnings:
        print(f"ipmasq {command}: warning: {warning}", file=sys.stderr)


def load_policy_config(args: argparse.Namespace, options: PolicyOptions) -> MasqConfig:
    """For the offline tools: no --config means the defaults; a --config that does not exist is an error (but for
    the running agent's config, which it reads as the defaults when no ConfigMap is mounted)."""
    if args.config is None:
        return load_config(None, options)
    if getattr(args, "config_missing_ok", False):
        return load_config(args.config, options, missing_ok=True)
    return load_config_or_manifest(args.config, options)


def load_config_or_manifest(path: str, options: PolicyOptions) -> MasqConfig:
    """A config file or directory, or a ConfigMap manifest, whose embedded config is read (line numbers kept).

    Operators hold the manifest they are about to `kubectl apply`; read as a raw config, its keys would be ignored
    as unknown and the defaults would silently stand in for what it says.
    """
    config_input = read_config_input(path, missing_ok=False)
    if len(config_input.files) == 1:
        source, data = config_input.files[0]
        try:
            embedded = configmap_config(data.decode("utf-8"))
        except UnicodeDecodeError:
            embedded = None  # the loader reports it, with its position
        except ValueError as exc:
            raise ConfigError(str(exc), source=source) from None
        if embedded is not None:
            config_input = ConfigInput(((source, embedded.encode("utf-8", "surrogatepass")),))
    return config_from_bytes(config_input, options)
