"""Configuration precedence (command line > environment > file > defaults) over every subcommand."""

from __future__ import annotations

import argparse
import os

import pytest

from splitinfer.cli import build_parser, main
from splitinfer.configfile import apply_config, cmd_config, env_name, is_secret
from splitinfer.errors import ConfigError

FILE = """
[defaults]
device = "cuda:1"
threads = 3

[serve]
port = 1111
shard = "from-file/cloud"
session-ttl = 60

[generate]
prompt = "from the file"
no_chat = true
"""


def parsed(argv, tmp_path, environ=None, text=FILE):
    path = tmp_path / "splitinfer.toml"
    path.write_text(text)
    parser = build_parser()
    argv = ["--config", str(path), *argv]
    report = apply_config(parser, argv, environ or {})
    return parser.parse_args(argv), report


def test_precedence_command_line_over_environment_over_file_over_defaults(tmp_path):
    args, report = parsed(["serve"], tmp_path)
    assert (args.port, args.shard, args.session_ttl, args.device, args.threads) == (1111, "from-file/cloud", 60.0, "cuda:1", 3)
    assert args.max_sessions == 64 and report["serve"]["max_sessions"].source == "default"
    assert report["serve"]["port"].source == "file" and report["serve"]["device"].origin.endswith("[defaults]")

    env = {"SPLITINFER_SERVE_PORT": "2222", "SPLITINFER_SERVE_DEVICE": "cpu"}
    args, report = parsed(["serve"], tmp_path, env)
    assert (args.port, args.device) == (2222, "cpu") and report["serve"]["port"].origin == "SPLITINFER_SERVE_PORT"

    args, _ = parsed(["serve", "--port", "3333"], tmp_path, env)
    assert args.port == 3333


def test_required_options_and_flags_can_come_from_file_or_environment(tmp_path):
    args, _ = parsed(["generate"], tmp_path)  # --prompt is required on the command line otherwise
    assert args.prompt == "from the file" and args.no_chat is True
    args, _ = parsed(["generate"], tmp_path, {"SPLITINFER_GENERATE_NO_CHAT": "false"})
    assert args.no_chat is False
    # Commands registered by other modules are covered too.
    args, _ = parsed(["chat"], tmp_path, {"SPLITINFER_CHAT_MAX_NEW_TOKENS": "17", "SPLITINFER_CHAT_TOKEN_FILE": "~/t"})
    assert args.max_new_tokens == 17 and args.device == "cuda:1"
    assert args.token_file == os.path.expanduser("~/t") != "~/t"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate"])  # without the file, --prompt is still required


@pytest.mark.parametrize("text, env, message", [
    ("[serve]\nprot = 1\n", {}, "has no option 'prot'"),
    ("[serv]\nport = 1\n", {}, "is not a command"),
    ("[defaults]\ndevise = \"cpu\"\n", {}, "option of no command"),
    ("[serve]\nport = \"many\"\n", {}, "must be an integer"),
    ("[serve]\nport = 1.5\n", {}, "must be an integer"),
    ("[generate]\nstrategy = \"fast\"\n", {}, "must be one of"),
    ("[serve\n", {}, "not valid TOML"),
    ("", {"SPLITINFER_SERVE_PORT": "x"}, "SPLITINFER_SERVE_PORT must be an integer"),
    ("", {"SPLITINFER_GENERATE_NO_CHAT": "maybe"}, "must be true or false"),
])
def test_bad_settings_are_one_clear_error(tmp_path, text, env, message):
    with pytest.raises(ConfigError, match=message):
        parsed(["serve"], tmp_path, env, text)


def test_missing_explicit_file_is_an_error(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.toml"), "config", "show"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_show_prints_sources_and_masks_secrets(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.toml"
    path.write_text(FILE)
    monkeypatch.setenv("SPLITINFER_SERVE_MAX_SESSIONS", "5")
    monkeypatch.setenv("SPLITINFER_TOKEN", "s3cret-token")
    assert main(["--config", str(path), "config", "show", "--command", "serve"]) == 0
    out = capsys.readouterr().out
    assert f"port = 1111  # file: {path} [serve]" in out
    assert "max_sessions = 5  # env: SPLITINFER_SERVE_MAX_SESSIONS" in out
    assert "host = \"127.0.0.1\"  # default" in out
    assert "s3cret" not in out and "SPLITINFER_TOKEN = ****" in out

    # An option that holds a secret is masked wherever its value came from.
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("x")
    s.add_argument("--api-key")
    s.add_argument("--token-file")
    report = apply_config(parser, ["x"], {env_name("x", "api_key"): "hunter2", env_name("x", "token_file"): "/t"})
    cmd_config(argparse.Namespace(config_report=report, only="x", json=False))
    out = capsys.readouterr().out
    assert "hunter2" not in out and 'api_key = "****"' in out and 'token_file = "/t"' in out
    assert is_secret("token") and not is_secret("max_cached_tokens") and not is_secret("token_file")


def test_the_api_binds_to_loopback_unless_told_otherwise(tmp_path):
    args, _ = parsed(["api"], tmp_path, text="")
    assert args.host == "127.0.0.1" and args.port == 8000
