"""The CLI: every command's help, options that mirror config fields keep their defaults, one list of choices,
and option mistakes end as one line before anything loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitinfer.cli import build_parser, main
from splitinfer.configfile import apply_config, subcommands
from splitinfer.options import CommandParser, complete

# Options that deliberately set their own default instead of the field's; anything else must match.
OVERRIDDEN = {
    ("generate", "temperature"),  # 0 = greedy; SamplingConfig is built only when sampling
    ("chat", "temperature"),
    ("wan", "rtt_ms"),  # the 80 ms the project emulates by default; WanConfig adds nothing by default
    ("privacy privatize", "steps"),
}
# A sample of options that must be derived from a config, so taking one back to a literal fails here.
MUST_MIRROR = {
    ("serve", "port"), ("serve", "session_ttl"), ("serve", "max_message_mb"), ("serve", "kv_budget_mb"),
    ("serve", "batch_window_ms"), ("serve", "max_batch"), ("serve", "max_sessions_per_token"),
    ("generate", "prefill_chunk"), ("generate", "wire_dtype"), ("generate", "ngram"), ("generate", "top_p"),
    ("chat", "prefill_chunk"), ("api", "prefill_chunk"), ("api", "wire_dtype"),
    ("wan", "jitter_ms"), ("wan", "spike_prob"), ("bench plan", "cloud_tflops"), ("privacy privatize", "rank"),
    ("generate", "max_new_tokens"), ("generate", "strategy"), ("generate", "device"), ("api", "port"),
    ("prepare", "head_layers"), ("bench plan", "head_layers"), ("bench plan", "dtype"), ("privacy table", "depth"),
    ("demo", "shards"), ("bench spec", "max_new_tokens"), ("bench batch", "rtt_ms"), ("serve", "tp"),
}


@pytest.fixture(scope="module")
def commands():
    return {name: complete(sub) for name, sub in subcommands(build_parser()).items()}


def _mirrors(commands):
    return {(name, a.dest): a for name, sub in commands.items() for a in sub._actions if hasattr(a, "mirror")}


def test_every_mirrored_option_has_its_fields_default(commands):
    mirrors = _mirrors(commands)
    assert MUST_MIRROR <= set(mirrors)
    overridden = {key for key, action in mirrors.items() if action.mirror.overridden}
    assert overridden == OVERRIDDEN
    for key, action in mirrors.items():
        if key not in OVERRIDDEN:
            assert action.default == action.mirror.field_default(), key
            assert type(action.default) is type(action.mirror.field_default()), key


def test_the_parsed_defaults_rebuild_the_default_configs():
    from splitinfer.cloud.commands import BATCH_OPTIONS, SESSION_OPTIONS
    from splitinfer.cloud.scheduler import BatchConfig
    from splitinfer.cloud.sessions import SessionConfig
    from splitinfer.decoding.strategies import LookaheadConfig
    from splitinfer.local.commands import CLIENT_OPTIONS, LOOKAHEAD_OPTIONS
    from splitinfer.local.session import ClientConfig
    from splitinfer.netem import WanConfig
    from splitinfer.netem.commands import WAN_OPTIONS, WAN_RTT_MS
    from splitinfer.options import config_from_args

    parser = build_parser()
    serve = parser.parse_args(["serve", "--shard", "s"])
    assert config_from_args(SessionConfig, serve, SESSION_OPTIONS) == SessionConfig()
    assert config_from_args(BatchConfig, serve, BATCH_OPTIONS) == BatchConfig()
    generate = parser.parse_args(["generate", "--prompt", "p"])
    assert config_from_args(ClientConfig, generate, CLIENT_OPTIONS) == ClientConfig()
    assert config_from_args(LookaheadConfig, generate, LOOKAHEAD_OPTIONS) == LookaheadConfig()
    wan = parser.parse_args(["wan", "--listen", "1", "--upstream", "h:2"])
    assert config_from_args(WanConfig, wan, WAN_OPTIONS) == WanConfig(rtt_ms=WAN_RTT_MS)
    budget = parser.parse_args(["serve", "--shard", "s", "--kv-budget-mb", "1.5", "--max-message-mb", "2"])
    got = config_from_args(SessionConfig, budget, SESSION_OPTIONS)
    assert (got.max_kv_bytes, got.max_message_bytes) == (3 * 512 * 1024, 2 * 1024 * 1024)


def test_choices_come_from_one_list(commands):
    from splitinfer.decoding.strategies import STRATEGIES
    from splitinfer.wire.frame import WIRE_DTYPES

    for name in ("generate", "chat", "api"):
        actions = {a.dest: a for a in commands[name]._actions}
        assert tuple(actions["strategy"].choices) == tuple(STRATEGIES)
        assert tuple(actions["wire_dtype"].choices) == tuple(WIRE_DTYPES)
    for name, dest in (("prepare", "dtype"), ("serve", "dtype"), ("bench plan", "dtype"), ("bench plan", "wire_dtype"),
                       ("bench load", "wire_dtype"), ("bench batch", "dtype")):
        action = next(a for a in commands[name]._actions if a.dest == dest)
        assert tuple(action.choices) == tuple(WIRE_DTYPES), (name, dest)


@pytest.mark.parametrize("name", sorted(subcommands(build_parser())))
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*name.split(), "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: splitinfer {name}") and "--help" in out
    assert f"\nexample: splitinfer {name} " in out  # every help ends with a line to copy


@pytest.mark.parametrize("group", ["bench", "privacy", "drafter"])
def test_groups_list_their_commands_with_an_example(group, capsys):
    with pytest.raises(SystemExit):
        main([group, "--help"])
    out = capsys.readouterr().out
    assert f"\nexample: splitinfer {group} " in out
    assert all(name.split()[1] in out for name in subcommands(build_parser()) if name.startswith(group + " "))


def test_the_top_level_lists_a_few_commands_and_the_version(capsys):
    parser = build_parser()
    top = next(a for a in parser._actions if a.dest == "command").choices
    assert len(top) <= 12, sorted(top)  # the twelfth: kernels (build them at a set-up step, say which run)
    assert {"bench", "privacy", "drafter", "prepare", "serve", "api"} <= set(top)
    assert not any("-" in name for name in top)  # bench-spec and friends are gone
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    from splitinfer import __version__

    assert capsys.readouterr().out.strip() == f"splitinfer {__version__}"


def test_grouped_commands_take_settings_from_nested_tables_and_their_own_variables(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[bench.spec]\nmax-new-tokens = 7\n")
    parser = build_parser()
    report = apply_config(parser, ["--config", str(path), "bench", "spec"], {"SPLITINFER_BENCH_SPEC_REPEATS": "3"})
    args = parser.parse_args(["bench", "spec"])
    assert (args.max_new_tokens, args.repeats) == (7, 3)
    assert report["bench spec"]["max_new_tokens"].origin.endswith("[bench.spec]")
    path.write_text("[bench.nope]\nx = 1\n")
    from splitinfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[bench.nope\] is not a command"):
        apply_config(build_parser(), ["--config", str(path), "bench", "spec"], {})


def test_every_command_is_registered_beside_its_code():
    parser = build_parser()
    for name, sub in subcommands(parser).items():
        func = sub._defaults["func"]
        assert func.__module__ != "splitinfer.cli", name


def test_help_and_light_commands_do_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from splitinfer.cli import build_parser, main\n"
        "from splitinfer.configfile import apply_config\n"
        "for argv in (['--help'], ['wan', '--help'], ['bench', 'plan', '--help'], ['bench', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "parser = build_parser()\n"
        "apply_config(parser, ['wan', '--listen', '1', '--upstream', 'h:1'], {})\n"
        "parser.parse_args(['wan', '--listen', '1', '--upstream', 'h:1'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_settings_are_read_only_for_the_commands_involved():
    parser = build_parser()
    report = apply_config(parser, ["wan", "--listen", "1", "--upstream", "h:1"], {})
    assert set(report) == {"wan", "_file"}
    serve = subcommands(parser)["serve"]
    assert isinstance(serve, CommandParser) and serve.deferred  # not built
    report = apply_config(build_parser(), ["wan"], {"SPLITINFER_SERVE_PORT": "1"})
    assert report["serve"]["port"].source == "env"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--shard", "/nonexistent", "--session-ttl", "0"], "Fix --session-ttl"),
    (["serve", "--shard", "/nonexistent", "--max-batch", "0"], "Fix --batch-window-ms or --max-batch"),
    (["serve", "--shard", "/nonexistent", "--kv-budget-mb", "0"], "--kv-budget-mb must be positive"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature must be"),
    (["generate", "--prompt", "x", "--strategy", "lookahead", "--ngram", "1"], "lookahead needs --ngram >= 2"),
    (["generate", "--prompt", "x"], "give --shard"),
    (["chat"], "give --shard"),
    (["api"], "give --shard"),
    (["generate", "--prompt", "x", "--shard", "s", "--server", "http://h:1"], "--server must look like ws://"),
    (["prepare", "--out", "/nonexistent", "--split-range", "4-2"], "--split-range must be K1-K2"),
    (["wan", "--listen", "0", "--upstream", "nohost"], "--upstream must be HOST:PORT"),
    (["wan", "--listen", "0", "--upstream", "h:1", "--cut-after-s", "-1"], "Fix --cut-after-s"),
])
def test_option_mistakes_are_one_line_before_anything_loads(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitinfer: error:") and err.count("\n") == 1 and message in err, err
