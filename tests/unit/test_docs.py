"""The manual cannot drift from the code: the reference names every flag, metric, finding id, exit code and document
kind the code has; the README stays a short front page; every link between the pages leads somewhere.

A failure names exactly what is missing and the page to add it to (a new flag: a row in its command's table of
docs/reference/cli.md, and so on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ipmasq.agent.metrics import AgentVitals, render_metrics
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
    served = re.findall(r"^# TYPE (\S+) ", render_metrics(AgentVitals(version="0", backend="iptables")).decode(),
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
    from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS
    from ipmasq.lab.scenarios import SCENARIOS

    index = (DOCS / "how-to" / "README.md").read_text()
    missing = [name for name in [*SCENARIOS, *ROUTED_SCENARIOS, FLEET_SCENARIO] if f"`{name}`" not in index]
    assert not missing, _missing_message("lab scenarios", missing, "docs/how-to/README.md (a how-to each)")
    for page in sorted((DOCS / "how-to").glob("*.md")):
        if page.name != "README.md" and page.name[:-3] not in {p.split("/")[-1][:-3] for p in PAGES_OF_OTHERS}:
            text = page.read_text()
            assert "## Symptom" in text and "## Fix" in text, f"{page.relative_to(ROOT)}: no Symptom or Fix section"
            assert f"({page.name})" in index, f"docs/how-to/README.md does not link {page.name}"


def test_each_routed_scenarios_how_to_answers_with_one_trace_command() -> None:
    """Which address a partner's firewall sees, on a node whose routing decides it, is one command from a
    workstation: `kubectl ipmasq trace NODE DEST --source POD_IP --protocol tcp --port P`, its output pasted (the
    kernel test tests/kernel/lab/test_routed.py compares it with what trace prints on the lab's node), and no
    `ip route get` on the node or address given by hand beside it."""
    from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS
    from tests.kernel.lab.test_routed import PAGES, transcripts

    index = (DOCS / "how-to" / "README.md").read_text()
    assert set(PAGES) == set(ROUTED_SCENARIOS)
    for name, (page, phases) in PAGES.items():
        row = next(line for line in index.splitlines() if line.startswith("|") and f"`{name}`" in line)
        assert f"]({page})" in row, f"docs/how-to/README.md: the row of `{name}` does not link {page}"
        text = (DOCS / "how-to" / page).read_text()
        diagnose = text.split("## Diagnose", 1)[1].split("\n## ", 1)[0]
        blocks = transcripts(name)
        assert len(blocks) == len(phases) and blocks, f"{page}: {len(blocks)} trace transcripts"
        for args, printed in blocks:
            assert re.fullmatch(r"\S+ --source \S+ --protocol tcp --port \d+", args), f"{page}: trace {args}"
            assert "the destination sees" in printed or "CANNOT DECIDE" in printed, f"{page}: trace {args}"
        assert "ip route get" not in diagnose, f"{page}: its Diagnose still asks the node's kernel by hand"
        commands = re.findall(r"^ {4}\$? ?kubectl ipmasq trace .*$", diagnose, re.MULTILINE)
        assert commands and not [c for c in commands if "--local-address" in c or "--out-interface" in c], \
            f"{page}: {commands}: trace reads the node's addresses and routes itself"


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


def test_every_how_to_whose_fix_is_an_ipmasq_only_key_says_it_needs_ipmasq_enforcing() -> None:
    """masqueradeCIDRs, rules and enableIPv6 are ipmasq's own: a provider's agent ignores them (ignored-by-writer),
    so a fix that uses one says so, and how to find out before apply."""
    missing = []
    for page in sorted((DOCS / "how-to").glob("*.md")):
        text = page.read_text()
        fix = text.split("## Fix", 1)[1].split("\n## ", 1)[0] if "## Fix" in text else ""
        if re.search(r"masqueradeCIDRs|^\s*rules:|`rules`|enableIPv6", fix, re.MULTILINE) and (
                "Needs ipmasq enforcing" not in fix or "lint --writer" not in fix):
            missing.append(str(page.relative_to(ROOT)))
    assert not missing, f"say 'Needs ipmasq enforcing' and `ipmasq lint --writer` in the Fix of: {missing}"


# ---- links, anchors, images and tags as a reader follows them --------------------------------------------------

MARKDOWN = [*sorted(ROOT.glob("*.md")), *sorted(DOCS.rglob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lowercased, punctuation but `-` and `_` dropped, spaces to
    hyphens, a repeated one suffixed -1, -2...) and the page's explicit `<a id>`/`<a name>` ones."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", plain.replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def _anchored_links() -> list[tuple[Path, Path, str]]:
    found = []
    for page in MARKDOWN:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            found.append((page, (page.parent / target).resolve() if target else page, anchor))
    return found


def test_every_anchor_a_link_names_is_a_heading_of_its_page() -> None:
    dead = [f"{page.relative_to(ROOT)} -> {target.relative_to(ROOT)}#{anchor}"
            for page, target, anchor in _anchored_links()
            if target.suffix == ".md" and target.exists() and anchor not in _anchors(target)]
    assert not dead, f"links to an anchor that is no heading of the page: {dead}"


def test_the_anchor_rule_is_githubs() -> None:
    """The slug rule above on headings of the shapes the docs use (GitHub's own anchors for them)."""
    page = ROOT / "README.md"
    assert "the-two-commands" in _anchors(page)
    sample = DOCS / "measurements.md"
    assert "the-kubernetes-labs-first-build" in _anchors(sample)


# an image a reader is told to run: `--image=...`, `--image ...`, `image: ...` (placeholders in capitals aside)
_IMAGE = re.compile(r"(?:--image[= ]|\bimage: *)([a-z0-9][\w./:@-]*[\w])")


def test_every_image_the_docs_name_has_a_registry_host() -> None:
    bare = []
    for page in MARKDOWN:
        for image in _IMAGE.findall(page.read_text()):
            host = image.split("/", 1)[0] if "/" in image else ""
            if not ("." in host or ":" in host or host == "localhost"):
                bare.append(f"{page.relative_to(ROOT)}: {image}")
    assert not bare, f"images without a registry host (a bare name is Docker Hub's, not this project's): {bare}"


def test_the_projects_image_in_the_docs_is_this_release() -> None:
    """A command that runs ipmasq's own image runs the release this checkout is (the CHANGELOG's history aside)."""
    from ipmasq import __version__
    from ipmasq.version import IMAGE_REPOSITORY

    stale = [f"{page.relative_to(ROOT)}: {image}" for page in MARKDOWN if page.name != "CHANGELOG.md"
             for image in _IMAGE.findall(page.read_text())
             if image.startswith(IMAGE_REPOSITORY + ":")
             and image.partition("@")[0] != f"{IMAGE_REPOSITORY}:{__version__}"]
    assert not stale, f"ipmasq's image named at another release than {__version__}: {stale}"


def _tags() -> set[str]:
    import shutil
    import subprocess

    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        return set()
    listed = subprocess.run(["git", "-C", str(ROOT), "tag", "-l"], capture_output=True, text=True, timeout=30)
    return set(listed.stdout.split())


def test_no_command_in_the_docs_needs_a_git_tag_the_repository_lacks() -> None:
    tags = _tags()
    needs = []
    for page in MARKDOWN:
        for line in page.read_text().splitlines():
            if re.search(r"\bgit (?:checkout|switch|show|archive|diff|log|worktree add|clone)\b", line):
                needs += [f"{page.relative_to(ROOT)}: {tag} in `{line.strip()}`"
                          for tag in re.findall(r"\bv\d+\.\d+\.\d+\b", line) if tag not in tags]
    assert not needs, f"git commands naming tags this repository does not have (name the commit instead): {needs}"
