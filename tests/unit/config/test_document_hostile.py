"""Hostile config input never takes ipmasq down: each case ends in one error line naming the file (and the line
where there is one), exit 1, in bounded time and memory, for the loader, `render`, `explain` and `lint`.

The cases are what hostile testing found: nesting that overflowed the recursive composers (a RecursionError at
~400 levels of YAML or ~1,000 of JSON, a segfault at 100,000), a 456-byte alias bomb that grew past 1.5 GiB, a 50 MB
file, a FIFO and /dev/zero (which blocked forever or ate GiBs), and a resyncInterval that overflowed select().
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from ipmasq.config import ConfigInput, config_from_bytes, load_config, read_config_input
from ipmasq.config.document import MAX_ALIAS_VALUES, MAX_DEPTH
from ipmasq.config.source import MAX_CONFIG_BYTES
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions

OPTIONS = PolicyOptions()


def alias_bomb() -> bytes:
    """Billion laughs: nine levels of nine aliases each, 9**9 (387 million) strings once expanded."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    lines[-1] = lines[-1].replace("i: &i", "nonMasqueradeCIDRs: &i")
    return ("\n".join(lines) + "\n").encode()


# name -> (file content, the line the error names or None when the message carries none, words of the message)
NESTED: dict[str, tuple[bytes, int | None, str]] = {
    "yaml-flow-400": (b"[" * 400 + b"]" * 400, 1, f"nested deeper than {MAX_DEPTH} levels"),
    "yaml-flow-unclosed-400": (b"[" * 400, 1, f"nested deeper than {MAX_DEPTH} levels"),
    "yaml-block-maps-400": (b"".join(b"  " * i + b"a:\n" for i in range(400)), MAX_DEPTH + 1,
                            f"nested deeper than {MAX_DEPTH} levels"),
    "yaml-compact-seqs-1000": (b"- " * 1000 + b"x\n", 1, f"nested deeper than {MAX_DEPTH} levels"),
    "yaml-flow-100000": (b"a: " + b"[" * 100_000 + b"]" * 100_000, 1, f"nested deeper than {MAX_DEPTH} levels"),
    "json-1000": (b'{"a":' + b"[" * 1000 + b"]" * 1000 + b"}", 1, f"nested deeper than {MAX_DEPTH} levels"),
    "json-100000": (b'{"a":\n' + b"[" * 100_000 + b"]" * 100_000 + b"}", 2, f"nested deeper than {MAX_DEPTH} levels"),
    "alias-bomb": (alias_bomb(), None, f"YAML aliases repeat this value past {MAX_ALIAS_VALUES:,} values"),
    "alias-to-itself": (b"nonMasqueradeCIDRs: &a [*a]\n", 1, "a YAML alias refers to the value that contains it"),
    "resync-past-go-duration": (b"resyncInterval: 1000000000h\n", 1,
                                'resyncInterval: time: invalid duration "1000000000h"'),
}


def load_bytes(name: str, data: bytes) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        config_from_bytes(ConfigInput(((name, data),)), OPTIONS)
    return raised.value


def test_the_alias_bomb_is_the_small_one() -> None:
    assert len(alias_bomb()) < 500


@pytest.mark.parametrize("case", sorted(NESTED))
def test_the_loader_refuses_in_one_located_line(case: str) -> None:
    data, line, words = NESTED[case]
    error = load_bytes(f"/etc/config/{case}", data)
    message = str(error)
    assert "\n" not in message and len(message) < 200, message
    where = f"/etc/config/{case}:{line}: " if line is not None else f"/etc/config/{case}:"
    assert message.startswith(where), message
    assert words in message


def test_the_alias_bomb_stays_small_in_memory() -> None:
    tracemalloc.start()
    try:
        load_bytes("bomb.yaml", alias_bomb())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_aliases_within_the_budget_still_load() -> None:
    data = b"common: &c [10.0.0.0/8, 192.168.0.0/16]\nnonMasqueradeCIDRs: *c\n"
    config = config_from_bytes(ConfigInput((("aliases.yaml", data),)), OPTIONS)
    assert [str(e.prefix) for e in config.non_masquerade] == ["10.0.0.0/8", "192.168.0.0/16"]


def test_nesting_at_the_limit_is_a_type_error_not_a_depth_error() -> None:
    deepest = b"nonMasqueradeCIDRs: " + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"\n"
    assert "each entry must be a CIDR string, got a list" in str(load_bytes("deep.yaml", deepest))
    deeper = b"nonMasqueradeCIDRs: " + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"\n"
    assert "nested deeper than" in str(load_bytes("deep.yaml", deeper))


def test_aliases_cannot_nest_past_the_depth_limit() -> None:
    # each level of anchors is shallow; only the expansion is deep
    levels = [b"l0: &l0 [x]"] + [f"l{i}: &l{i} [[[[[[[[*l{i - 1}]]]]]]]]".encode() for i in range(1, 10)]
    assert "nested deeper than" in str(load_bytes("aliases.yaml", b"\n".join(levels) + b"\n"))


def test_a_huge_value_is_echoed_clipped() -> None:
    value = "x" * 900_000
    for text in (f"nonMasqueradeCIDRs: [{value}]\n", f"resyncInterval: {value}\n", f"cidrLimit: {value}\n",
                 f"masqLinkLocal: '{value}'\n", f'{{"nonMasqueradeCIDRs": ["{value}"]}}', f"{value}\n",
                 f"cidrLimit: {'9' * 5000}\n", f'{{"cidrLimit": {"9" * 5000}}}', f"!{value} x\n"):
        message = str(load_bytes("big.yaml", text.encode()))
        assert len(message) < 300 and "\n" not in message, message[:300]
        assert message.startswith("big.yaml")
    long_key = "k" * 1000  # YAML's longest implicit key
    warnings = config_from_bytes(ConfigInput((("big.yaml", f"{long_key}: 1\n".encode()),)), OPTIONS).warnings
    assert len(warnings) == 1 and len(warnings[0]) < 200


# --- reading: size and file kinds ----------------------------------------------------------------------------


def test_a_file_over_1_mib_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "ip-masq-agent"
    with big.open("wb") as fh:  # sparse: 50 MB that cost nothing, so that only reading it would
        fh.truncate(50_000_000)
    with pytest.raises(ConfigError) as raised:
        load_config(str(big), OPTIONS)
    assert str(raised.value) == (f"{big}: 50,000,000 bytes, too large: a config is at most 1 MiB "
                                 "(what a ConfigMap holds)")
    at_limit = tmp_path / "at-limit"
    at_limit.write_bytes(b"#" * MAX_CONFIG_BYTES)
    assert load_config(str(at_limit), OPTIONS).sources == ()  # a comment only: the defaults
    at_limit.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="1,048,577 bytes, too large"):
        load_config(str(at_limit), OPTIONS)


@pytest.mark.parametrize("kind", ["fifo", "char-device", "socket"])
def test_a_file_that_is_not_regular_is_never_opened(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "ip-masq-agent")
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would block until a writer comes
        expected = "a FIFO"
    elif kind == "char-device":
        path = "/dev/zero"  # reading it would never end
        expected = "a character device"
    else:
        import socket

        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        expected = "a socket"
    for missing_ok in (False, True):  # the agent, too, refuses it (and keeps its last good rules)
        with pytest.raises(ConfigError) as raised:
            read_config_input(path, missing_ok=missing_ok)
        assert str(raised.value).startswith(f"{path}: {expected}, not a regular file: not read")


def test_stdin_is_read_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    class Stdin:
        buffer = io.BytesIO(b"#" * (MAX_CONFIG_BYTES * 4))

    monkeypatch.setattr(sys, "stdin", Stdin())
    with pytest.raises(ConfigError, match=r"^<stdin>: more than 1,048,576 bytes, too large"):
        read_config_input("-", missing_ok=False)
    assert Stdin.buffer.tell() == MAX_CONFIG_BYTES + 1


def test_a_directory_without_config_files(tmp_path: Path) -> None:
    (tmp_path / "other").write_text("nonMasqueradeCIDRs: []\n")
    (tmp_path / "ip-masq-fifo").mkdir()  # not a file: skipped
    with pytest.raises(ConfigError) as raised:
        read_config_input(str(tmp_path), missing_ok=False)  # the offline tools
    assert str(raised.value) == (f"{tmp_path}: no ip-masq* file in this directory (the agent would run with its "
                                 "defaults)")
    assert read_config_input(str(tmp_path), missing_ok=True).files == ()  # the agent: the reference's defaults
    assert read_config_input(str(tmp_path / "missing"), missing_ok=True).files == ()


# --- the commands, as processes: exit 1, one line, bounded time and memory -----------------------------------

# Runs the CLI and then prints its own peak RSS (KiB) to stderr's last line: the memory of this one command.
# VmHWM, not getrusage's ru_maxrss, which a child inherits from the (large) pytest process that forked it.
DRIVER = ("import re, sys\nfrom ipmasq.cli import main\ncode = main(sys.argv[1:])\n"
          "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
          "print(f'maxrss={hwm}', file=sys.stderr)\nsys.exit(code)")
COMMAND_MEMORY_KIB = 50 * 1024  # the interpreter and imports: ~22 MiB; the bomb stops at ~33 MiB (it passed 1.5 GiB)
COMMAND_SECONDS = 30  # a FIFO used to block forever


def run_cli(*argv: str) -> tuple[int, str, str, int]:
    result = subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True,
                            timeout=COMMAND_SECONDS, stdin=subprocess.DEVNULL)
    *err_lines, peak = result.stderr.splitlines()
    assert peak.startswith("maxrss="), result.stderr[-2000:]
    return result.returncode, result.stdout, "\n".join(err_lines), int(peak.removeprefix("maxrss="))


def hostile_files(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, words the error must hold); each under its own directory, named as the agent's file."""
    files: dict[str, tuple[Path, str]] = {}
    for name, (data, _, words) in NESTED.items():
        path = root / name / "ip-masq-agent"
        path.parent.mkdir()
        path.write_bytes(data)
        files[name] = (path, words)
    big = root / "big" / "ip-masq-agent"
    big.parent.mkdir()
    with big.open("wb") as fh:
        fh.truncate(50_000_000)
    files["50-mb"] = (big, "50,000,000 bytes, too large")
    fifo = root / "fifo" / "ip-masq-agent"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    files["fifo"] = (fifo, "a FIFO, not a regular file")
    files["dev-zero"] = (Path("/dev/zero"), "a character device, not a regular file")
    return files


CLI_CASES = sorted([*NESTED, "50-mb", "fifo", "dev-zero"])


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return hostile_files(tmp_path_factory.mktemp("hostile"))


NOT_READ = frozenset({"50-mb", "dev-zero", "fifo"})


@pytest.mark.parametrize("case", CLI_CASES)
def test_render_refuses_in_one_line(hostile: dict[str, tuple[Path, str]], case: str) -> None:
    path, words = hostile[case]
    code, out, err, peak_kib = run_cli("render", "--config", str(path))
    # a config that is no regular file or too large is never read: could not run (3), not "an invalid config" (1)
    assert (code, out) == (3 if case in NOT_READ else 1, ""), err[-2000:]
    assert err.count("\n") == 0, err[-2000:]
    assert err.startswith(f"ipmasq render: {path}" if case in NOT_READ else f"ipmasq render: config error: {path}")
    assert words in err and len(err.replace(str(path), "")) < 300  # the name is as long as the temp dir's
    assert peak_kib < COMMAND_MEMORY_KIB, f"{peak_kib / 1024:.0f} MiB"


@pytest.mark.parametrize("case", CLI_CASES)
def test_lint_reports_in_one_line(hostile: dict[str, tuple[Path, str]], case: str) -> None:
    path, words = hostile[case]
    code, out, err, peak_kib = run_cli("lint", str(path))
    assert code == (3 if case in NOT_READ else 1) and "Traceback" not in err, err[-2000:]
    # read errors go to stderr alone; what was read and refused is one finding on stdout
    report = out if out else err
    lines = [line for line in report.splitlines() if str(path) in line]
    assert len(lines) == 1 and words in lines[0] and len(lines[0].replace(str(path), "")) < 400, report[-2000:]
    assert peak_kib < COMMAND_MEMORY_KIB, f"{peak_kib / 1024:.0f} MiB"


@pytest.mark.parametrize("command", ["render", "explain"])
def test_offline_commands_refuse_a_directory_without_config_files(tmp_path: Path, command: str) -> None:
    (tmp_path / "config.yaml").write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")  # not named ip-masq*
    argv = [command, "--config", str(tmp_path)] + (["8.8.8.8"] if command == "explain" else [])
    code, out, err, _ = run_cli(*argv)
    assert (code, out) == (1, "")
    assert err == f"ipmasq {command}: config error: {tmp_path}: no ip-masq* file in this directory (the agent would " \
                  "run with its defaults)"
