"""The manual cannot drift from the code: the reference names every flag, metric, finding id, exit code and document
kind the code has; the README stays a short front page; every link between the pages leads somewhere.

A failure names exactly what is missing and the page to add it to (a new flag: a row in its command's table of
docs/reference/cli.md, and so on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ipmasq.agent.metrics import AgentStatus, render_metrics
from ipmasq.cli import COMMANDS, Exit, build_parser, subcommands
from ipmasq.diagnose.check import FindingId
from ipmasq.diagnose.leftovers import OTHER_VARIANT_RULES
from ipmasq.kubectl_plugin import _FLAGS as PLUGIN_FLAGS
from ipmasq.kubectl_plugin import SUBCOMMANDS as PLUGIN_COMMANDS
from ipmasq.lint.hints import HINTS
from tests.conftest import ROOT

DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
README_WORDS = 1500
# pages other parts of the project write into the tree (install, upgrade, uninstall, monitoring, observe mode): the
# index links them before they exist in every checkout
PAGES_OF_OTHERS = {"operations/install.md", "operations/upgrade.md", "operations/uninstall.md",
                   "operations/monitoring.md", "operations/observe-mode.md", "how-to/observe-a-provider-agent.md"}


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _missing_message(what: str, missing: dict[str, list[str]] | list[str], page: str) -> str:
    listed = (", ".join(f"{k}: {' '.join(v)}" for k, v in missing.items() if v) if isinstance(missing, dict)
              else " ".join(missing))
    return f"{what} missing from {page}: {listed}"


def test_every_flag_of_every_subcommand_is_in_the_cli_reference() -> None:
    text = (REFERENCE / "cli.md").read_text()
    parsers = subcommands(build_parser())
    missing: dict[str, list[str]] = {}
    for command in COMMANDS:
        heading = f"## ipmasq {command}"
        if heading + "\n" not in text:
            missing[command] = ["(the section itself: `" + heading + "`)"]
            continue
        section = _section(text, heading)
        missing[command] = sorted(flag for action in parsers[command]._actions for flag in action.option_strings
                                  if flag not in ("-h", "--help") and f"`{flag}`" not in section)
    assert not any(missing.values()), _missing_message("flags", missing, "docs/reference/cli.md (a row each)")


def test_the_kubectl_plugin_is_in_the_cli_reference() -> None:
    section = _section((REFERENCE / "cli.md").read_text(), "## kubectl ipmasq")
    missing = [f for f in PLUGIN_FLAGS if f"`{f}`" not in section]
    missing += [f"kubectl ipmasq {name}" for name in PLUGIN_COMMANDS if f"kubectl ipmasq {name}" not in section]
    assert not missing, _missing_message("kubectl ipmasq flags and commands", missing, "docs/reference/cli.md")


def test_every_metric_the_agent_serves_is_in_the_metrics_reference() -> None:
    served = re.findall(r"^# TYPE (\S+) ", render_metrics(AgentStatus(version="0", backend="iptables")).decode(),
                        re.MULTILINE)
    assert "ipmasq_ready" in served and "process_resident_memory_bytes" in served
    text = (REFERENCE / "metrics.md").read_text()
    missing = [name for name in served if f"`{name}" not in text]
    assert not missing, _missing_message("metrics", missing, "docs/reference/metrics.md")


def test_every_finding_id_is_in_the_findings_reference() -> None:
    text = (REFERENCE / "findings.md").read_text()
    ids = sorted({*HINTS, *(str(f) for f in FindingId), OTHER_VARIANT_RULES})
    missing = [i for i in ids if f"`{i}`" not in text]
    assert not missing, _missing_message("finding ids", missing, "docs/reference/findings.md")


def test_every_exit_code_is_documented() -> None:
    text = (REFERENCE / "exit-codes.md").read_text()
    missing = [f"{code.value} ({code.name})" for code in Exit if not re.search(rf"^\| {code.value} \|", text, re.M)]
    assert not missing, _missing_message("exit codes", missing, "docs/reference/exit-codes.md (a row each)")


def test_every_document_kind_is_in_the_json_reference() -> None:
    kinds = set()
    for path in (ROOT / "src" / "ipmasq").rglob("*.py"):
        source = path.read_text()
        kinds |= set(re.findall(r'print_document\([^,]+, "([A-Za-z]+)"', source))
        kinds |= set(re.findall(r'"kind": "([A-Za-z]+Report)"', source))  # a document written by hand (diff)
    assert {"LintReport", "CheckReport", "DiffReport", "ExplainReport"} <= kinds, kinds
    text = (REFERENCE / "json.md").read_text()
    missing = sorted(k for k in kinds if f"`{k}`" not in text)
    assert not missing, _missing_message("document kinds", missing, "docs/reference/json.md")


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    words = len(re.findall(r"\S+", text))
    assert words <= README_WORDS, f"README.md has {words} words (at most {README_WORDS}): move detail under docs/"
    commands = re.findall(r"^    (bash scripts/\S+)$", text, re.MULTILINE)
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands  # the main job, the tests
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _links() -> list[tuple[Path, str]]:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [(page, target) for page in pages
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), _links(), ids=lambda v: str(v).replace(str(ROOT) + "/", ""))
def test_every_link_leads_to_a_file(page: Path, target: str) -> None:
    resolved = (page.parent / target).resolve()
    if str(resolved.relative_to(DOCS.resolve())) in PAGES_OF_OTHERS if resolved.is_relative_to(DOCS.resolve()) \
            else False:
        return
    assert resolved.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def test_every_lab_scenario_has_a_how_to_and_every_how_to_its_parts() -> None:
    """A scenario the lab reproduces is an incident an operator can have: the how-to index names it; each how-to
    says the symptom and the fix (most also how to diagnose and verify it, and the scenario that shows it)."""
    from ipmasq.commands.lab import FLEET_SCENARIO
    from ipmasq.lab.scenarios import SCENARIOS

    index = (DOCS / "how-to" / "README.md").read_text()
    missing = [name for name in [*SCENARIOS, FLEET_SCENARIO] if f"`{name}`" not in index]
    assert not missing, _missing_message("lab scenarios", missing, "docs/how-to/README.md (a how-to each)")
    for page in sorted((DOCS / "how-to").glob("*.md")):
        if page.name != "README.md" and page.name[:-3] not in {p.split("/")[-1][:-3] for p in PAGES_OF_OTHERS}:
            text = page.read_text()
            assert "## Symptom" in text and "## Fix" in text, f"{page.relative_to(ROOT)}: no Symptom or Fix section"
            assert f"({page.name})" in index, f"docs/how-to/README.md does not link {page.name}"


def test_the_readmes_transcripts_are_what_the_commands_print(capsys: pytest.CaptureFixture[str]) -> None:
    """Each `$ .venv/bin/ipmasq explain|lint ...` transcript of the README, run here: the lines printed below it."""
    from ipmasq.cli import main

    text = (ROOT / "README.md").read_text()
    transcripts = re.findall(r"^    \$ \.venv/bin/(ipmasq (?:explain|lint) (?:.*\\\n)*.*)\n((?:    (?!\$).*\n)+)",
                             text, re.MULTILINE)
    assert len(transcripts) >= 2
    for command, printed in transcripts:
        argv = command.replace("\\\n", " ").split()[1:]
        if argv[-1] == "bad.yaml":
            continue  # a file the reader writes
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 0, err
        assert " ".join((out + err).split()) == " ".join(printed.split()), command
