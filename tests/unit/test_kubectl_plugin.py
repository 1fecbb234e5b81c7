"""kubectl ipmasq: its own usage errors are one line and exit 2, before kubectl is asked anything."""

from __future__ import annotations

import pytest

from ipmasq.kubectl_plugin import _take_image, main


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["check", "--masq-chain=X"]) == 2
    assert "name the node first" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_the_image_flag_in_both_forms_is_taken_out_of_the_commands_flags() -> None:
    assert _take_image(["--image", "i:1", "--masq-chain=X"]) == (["--masq-chain=X"], "i:1")
    assert _take_image(["--masq-chain=X", "--image=i:2"]) == (["--masq-chain=X"], "i:2")
    assert _take_image(["--masq-chain=X"]) == (["--masq-chain=X"], None)


def test_uninstall_is_handed_to_the_fleet_uninstall(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["uninstall", "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out
    for flags in (["--timeout", "-1"], ["--no-such-flag"], ["--timeout", "x"]):
        assert main(["uninstall", *flags]) == 2
        usage = capsys.readouterr().err.strip()
        assert usage.startswith("kubectl ipmasq uninstall: ") and "\n" not in usage, usage
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # no cluster: one line, exit 1, no traceback
    assert main(["uninstall", "--dry-run"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kubectl ipmasq uninstall: ") and "\n" not in err
