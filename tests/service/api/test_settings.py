"""Settings come from flags, then PE_SERVE_* variables, then defaults; the zoo is found on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.loading import bundled_zoo
from service.cli import load_settings


def test_defaults_serve_the_bundled_zoo_on_loopback() -> None:
    settings = load_settings([])
    assert (settings.host, settings.port, settings.model_dir) == ("127.0.0.1", 8000, [])
    assert settings.max_body_bytes == 1 << 20
    assert settings.api_keys() == ()


def test_every_flag_is_also_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PE_SERVE_PORT", "9001")
    monkeypatch.setenv("PE_SERVE_MODEL_DIR", "/a:/b")
    monkeypatch.setenv("PE_SERVE_DEVICE", "cpu")
    monkeypatch.setenv("PE_SERVE_DTYPE", "float32")
    monkeypatch.setenv("PE_SERVE_MAX_CONTEXT", "2048")
    monkeypatch.setenv("PE_SERVE_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("PE_SERVE_MAX_QUEUE", "5")
    monkeypatch.setenv("PE_SERVE_API_KEY", "one, two")
    settings = load_settings([])
    assert settings.port == 9001
    assert settings.model_dir == [Path("/a"), Path("/b")]
    assert (settings.device, settings.dtype, settings.max_context) == ("cpu", "float32", 2048)
    assert (settings.max_batch_size, settings.max_queue) == (3, 5)
    assert settings.api_keys() == (b"one", b"two")


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PE_SERVE_PORT", "9001")
    monkeypatch.setenv("PE_SERVE_MAX_QUEUE", "5")
    settings = load_settings(["--port", "9002", "--model-dir", "x", "y", "--drain-timeout", "2.5"])
    assert (settings.port, settings.max_queue, settings.drain_timeout_s) == (9002, 5, 2.5)
    assert settings.model_dir == [Path("x"), Path("y")]


@pytest.mark.parametrize(
    "argv", [["--port", "70000"], ["--device", "tpu"], ["--max-batch-size", "0"], ["--max-context", "x"]]
)
def test_bad_flags_exit_with_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        load_settings(argv)
    assert stopped.value.code == 2
    assert "pe-serve" in capsys.readouterr().err


def test_bundled_zoo_lists_checkpoints_rope_first(tmp_path: Path) -> None:
    for scheme in ("alibi", "rope", "nope"):
        (tmp_path / f"zoo-{scheme}").mkdir()
        (tmp_path / f"zoo-{scheme}" / "config.json").write_text("{}")
    (tmp_path / "zoo-empty").mkdir()
    assert [path.name for path in bundled_zoo(tmp_path)] == ["zoo-rope", "zoo-alibi", "zoo-nope"]
