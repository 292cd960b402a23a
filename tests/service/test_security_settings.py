"""The security flags as settings: key files, per-key limits, TLS files; refused at start-up if unusable."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import load_settings, tls_options
from tests.tls import make_certificates


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The usage error `pe-serve` exits with (status 2) for `argv`."""
    with pytest.raises(SystemExit) as stopped:
        load_settings(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_a_key_file_adds_its_keys_to_the_flag_s(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotated monthly\n\nalpha\n  beta  \n#gamma\nalpha\n")
    settings = load_settings(["--api-key", "flag-key", "--api-key-file", str(keys)])
    assert settings.api_keys() == (b"flag-key", b"alpha", b"beta")


@pytest.mark.parametrize("content", [None, "", "\n# only a comment\n\n"])
def test_a_missing_or_empty_key_file_is_refused_at_start_up(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    message = refusal(["--api-key-file", str(keys)], capsys)
    assert "api_key_file" in message
    assert ("cannot read the key file" if content is None else "holds no key") in message


def test_per_key_limits_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings([]).max_concurrent_per_key == 0
    monkeypatch.setenv("PE_SERVE_MAX_CONCURRENT_PER_KEY", "3")
    monkeypatch.setenv("PE_SERVE_MAX_QUEUED_TOKENS_PER_KEY", "4096")
    settings = load_settings(["--max-concurrent-per-key", "5"])
    assert (settings.max_concurrent_per_key, settings.max_queued_tokens_per_key) == (5, 4096)


def test_tls_files_are_checked_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made = make_certificates(tmp_path)
    cert, key = made.server_cert, made.server_key
    settings = load_settings(
        ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(made.ca)]
    )
    assert tls_options(settings)["ssl_ca_certs"] == str(made.ca)
    assert "tls_cert and tls_key are given together" in refusal(["--tls-cert", str(cert)], capsys)
    assert "needs tls_cert" in refusal(["--tls-client-ca", str(cert)], capsys)
    swapped = refusal(["--tls-cert", str(key), "--tls-key", str(cert)], capsys)
    assert "cannot load the TLS files" in swapped
    assert "cannot load" in refusal(["--tls-cert", str(cert), "--tls-key", str(tmp_path / "none")], capsys)
