"""No Ray cluster needed: `conveyor serve` keeps Ray's token authentication, and takes the API key from the
environment or a file (never only from argv), each ingress reading a key file itself (issue 39, item 8)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conveyor.cli import build_parser
from conveyor.router.api_key import read_api_key_file
from conveyor.router.app import ServeArgs
from conveyor.router.serve_cli import check_api_key_settings, ray_auth_mode, serve_args_from


def test_token_auth_is_kept_unless_the_environment_turns_it_off(monkeypatch, caplog) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert ray_auth_mode() == "token"
    import os

    assert os.environ["RAY_AUTH_MODE"] == "token"  # the raylet and every worker inherit it
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="conveyor.serve"):
        assert ray_auth_mode() == "disabled"
    assert "anyone who can reach its ports" in caplog.text


def test_api_key_file_flag_reaches_the_ingress_settings(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key-file", str(key_file)])
    merged = serve_args_from(args, args.serve_parser)
    assert merged == {"api_key_file": str(key_file)}  # the key itself is in no config Serve stores
    settings = ServeArgs.model_validate(merged).ingress_settings()
    assert settings.api_key is None and settings.api_key_file == str(key_file)
    assert read_api_key_file(settings.api_key_file) == "s3cret"


def test_a_missing_or_empty_key_file_fails_before_ray_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        check_api_key_settings(ServeArgs(api_key_file=str(tmp_path / "absent")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        check_api_key_settings(ServeArgs(api_key_file=str(tmp_path / "empty")))


def test_a_key_on_the_command_line_is_warned_about(monkeypatch, caplog) -> None:
    monkeypatch.setattr("sys.argv", ["conveyor", "serve", "--api-key", "k"])
    with caplog.at_level(logging.WARNING, logger="conveyor.serve"):
        check_api_key_settings(ServeArgs(api_key="k"))
    assert "process list" in caplog.text
    caplog.clear()
    monkeypatch.setattr("sys.argv", ["conveyor", "serve"])
    with caplog.at_level(logging.WARNING, logger="conveyor.serve"):
        check_api_key_settings(ServeArgs(api_key="k"))  # from $CONVEYOR_API_KEY: nothing to warn about
    assert "process list" not in caplog.text
