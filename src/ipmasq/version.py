"""Which build of ipmasq this is: the release (`ipmasq.__version__`, the one place it is written) and, where it can be
known, the source revision it was built from.

    from a git checkout (an editable install)   the checkout's commit, `git describe --always --dirty`
    from an image                               the file REVISION_FILE under the environment's prefix, written by
                                                scripts/install-image.sh from the Dockerfile's REVISION build argument
    from a wheel anywhere else                  the release alone

Asked only by `--version` (never at import: `ipmasq health` runs every few seconds as an exec probe, and must not
start git).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ipmasq import __version__

__all__ = ["IMAGE", "IMAGE_REPOSITORY", "REVISION_FILE", "VersionAction", "revision", "version_line"]

# the image the project publishes (deploy/ installs it; scripts/release-image.sh pushes yours and pins deploy/ to it)
IMAGE_REPOSITORY = "ghcr.io/ipmasq/ipmasq"
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"

REVISION_FILE = Path("share") / "ipmasq" / "revision"  # under sys.prefix: the image's virtual environment
REVISION_MAX_BYTES = 128  # a commit id and a word; anything longer is not a revision this build wrote
GIT_SECONDS = 2.0


def _from_checkout(package: Path) -> str | None:
    """The commit of the checkout the package is imported from, if it is one (an installed wheel is not)."""
    root = package.parent.parent  # src/ipmasq -> the checkout
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None
    try:
        result = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12",
                                 "--exclude=*"], capture_output=True, text=True, timeout=GIT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = result.stdout.strip()
    return text if result.returncode == 0 and _plausible(text) else None


def _from_file(prefix: Path) -> str | None:
    try:
        with open(prefix / REVISION_FILE, "rb") as file:
            data = file.read(REVISION_MAX_BYTES + 1)
    except OSError:
        return None
    text = data.decode("ascii", "replace").strip()
    return text if len(data) <= REVISION_MAX_BYTES and _plausible(text) else None


def _plausible(text: str) -> bool:
    """A commit id, possibly with `-dirty`: hex digits and dashes, nothing a terminal would act on."""
    return bool(text) and all(c in "0123456789abcdefdirty-" for c in text)


def revision(*, package: Path | None = None, prefix: Path | None = None) -> str | None:
    """The source revision of this build, or None where nothing says it."""
    found = _from_checkout(package or Path(__file__).resolve().parent)
    return found if found is not None else _from_file(prefix or Path(sys.prefix))


def version_line(*, package: Path | None = None, prefix: Path | None = None) -> str:
    """What `ipmasq --version` prints: `ipmasq 0.2.0 (commit 0123456789ab)`, or `ipmasq 0.2.0`."""
    found = revision(package=package, prefix=prefix)
    return f"ipmasq {__version__}" + (f" (commit {found})" if found else "")


class VersionAction(argparse.Action):
    """argparse's `version` action, the line computed only when asked (a checkout's commit runs git)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help=kwargs.get("help", "print the version (and the source commit) and exit"))

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()
