"""Bad input stops the program with one readable line; TOML files and flags agree."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seedflood.cli import build_parser, main
from seedflood_p2p.core.flags import run_config_from_args

ROOT = Path(__file__).resolve().parents[1]


def _error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ")
    return err[-1]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub lookup must fail fast, not hang


def test_unknown_model_names_the_problem_and_the_fix(capsys):
    line = _error_line(
        capsys, ["eval", "--model", "no-such-org/no-such-model", "--dataset", "synthetic-sentiment"]
    )
    assert "cannot load model 'no-such-org/no-such-model'" in line
    assert "built-in name" in line


def test_corrupt_ledger(capsys, tmp_path):
    bad = tmp_path / "ledger.sqlite"
    bad.write_bytes(b"garbage" * 500)
    line = _error_line(capsys, ["replay", "--ledger", str(bad), "--out", str(tmp_path / "o")])
    assert "corrupt or not a seedflood ledger" in line


def test_foreign_sqlite_file_is_refused_and_left_untouched(capsys, tmp_path):
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (x)")
    line = _error_line(capsys, ["replay", "--ledger", str(other), "--out", str(tmp_path / "o")])
    assert "not a seedflood ledger" in line
    with sqlite3.connect(other) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master")]
        assert tables == ["notes"] and db.execute("PRAGMA journal_mode").fetchone()[0] != "wal"


def test_dataset_without_the_needed_columns(capsys, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"sentence": f"s{i}", "y": i % 2}) for i in range(20)))
    line = _error_line(capsys, ["eval", "--model", "tiny-llama", "--dataset", str(data)])
    assert "text" in line and "sentence" in line and "--text-column" in line


def test_rank_larger_than_a_layer_allows(capsys, tmp_path):
    line = _error_line(
        capsys,
        [
            "train",
            "--model",
            "tiny-llama",
            "--dataset",
            "synthetic-sentiment",
            "--rank",
            "1000",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
    )
    assert "rank 1000 is larger than weight" in line and "choose a rank <=" in line


def test_invalid_settings_and_config_files(capsys, tmp_path):
    assert "eps must be a positive finite number" in _error_line(capsys, ["eval", "--eps", "-1"])
    bad_key = tmp_path / "a.toml"
    bad_key.write_text("rnak = 4\n")
    assert "unknown setting(s) rnak" in _error_line(capsys, ["eval", "--config", str(bad_key)])
    bad_type = tmp_path / "b.toml"
    bad_type.write_text('rank = "four"\n')
    assert "'rank' must be int" in _error_line(capsys, ["eval", "--config", str(bad_type)])
    assert "does not exist" in _error_line(capsys, ["eval", "--config", str(tmp_path / "x")])
    assert "cannot read config file" in _error_line(capsys, ["eval", "--config", str(tmp_path)])
    assert "no bootstrap address" in _error_line(capsys, ["peer"])
    boot = ["--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/QmX"]
    line = _error_line(
        capsys, ["peer", *boot, "--history-sync", "background", "--checkpoint-fetch", "never"]
    )
    assert "--history-sync background" in line and "--checkpoint-fetch auto or always" in line
    line = _error_line(capsys, ["eval", "--examples", "0"])
    assert "nothing to evaluate" in line and ">= 1" in line


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--round-deadline", "nan"], "'round_deadline' must be seconds, from 0 to"),
        (["--round-deadline", "-1"], "'round_deadline' must be seconds"),
        (["--liveness-timeout", "inf"], "'liveness_timeout' must be seconds"),
        (["--linger-max", "1e300"], "'linger_max' must be seconds"),
        (["--publish-rate", "0"], "'publish_rate' must be messages per second, above 0"),
        (["--publish-rate", "-5"], "'publish_rate'"),
        (["--repair-interval", "0"], "'repair_interval' must be seconds, above 0"),
        (["--call-timeout", "nan"], "'call_timeout'"),
        (["--metrics-port", "70000"], "'metrics_port' must be a TCP port (0: any free port)"),
        (["--metrics-port", "-1"], "'metrics_port'"),
        (["--until-round", "1" + "0" * 30], "'until_round' must be a round"),
        (["--max-ahead", "-1"], "'max_ahead'"),
        (["--threads", "-2"], "'threads'"),
    ],
)
def test_bad_daemon_settings_are_one_line(capsys, argv, problem):
    line = _error_line(capsys, ["peer", *argv])
    assert problem in line and "fix --" in line and "config file" in line


def test_bad_settings_in_a_config_file(capsys, tmp_path):
    cases = [
        ("peer", "round_deadline = nan", "'round_deadline' must be seconds"),
        ("peer", "publish_rate = -inf", "'publish_rate'"),
        ("bootstrap", "metrics_port = 65536", "'metrics_port' must be a TCP port"),
        ("eval", "rank = " + "9" * 5000, "number too long"),
        ("peer", "x = " + "[" * 3000 + "]" * 3000, "nests arrays or tables too deeply"),
        ("eval", "rank = 1" + "0" * 30, "rank must be 1..4096"),
        ("eval", "clip = inf", "clip must be in (0, 65504]"),
        ("eval", "eps = nan", "eps must be a positive finite number"),
        ("eval", "lr = -1.0", "lr must be a non-negative finite number"),
    ]
    for i, (command, text, problem) in enumerate(cases):
        path = tmp_path / f"{i}.toml"
        path.write_text(text + "\n")
        line = _error_line(capsys, [command, "--config", str(path)])
        assert problem in line, (text[:40], line)


def test_every_numeric_daemon_setting_has_bounds():
    import dataclasses

    from bootstrap.node import BootstrapSettings
    from peer.daemon import PeerSettings
    from seedflood_p2p.network.settings import NodeSettings

    for settings in (PeerSettings, NodeSettings, BootstrapSettings):
        for f in dataclasses.fields(settings):
            if f.type.replace(" | None", "") in ("int", "float"):
                assert "bounds" in f.metadata, f"{settings.__name__}.{f.name} has no bounds"


@pytest.mark.parametrize(
    "flag, address, problem",
    [
        (
            "--listen",
            "/ip4/127.0.0.1/tcp/99999",
            "listen address /ip4/127.0.0.1/tcp/99999 has port",
        ),
        ("--announce", "/ip4/1.2.3.4/tcp/0", "announce address /ip4/1.2.3.4/tcp/0 has port '0'"),
        ("--bootstrap", "/ip4/1.2.3.4/tcp/70000/p2p/x", "bootstrap address"),
    ],
)
def test_ports_outside_the_tcp_range(capsys, tmp_path, flag, address, problem):
    argv = ["peer", "--data-dir", str(tmp_path), flag, address]
    if flag != "--bootstrap":
        argv += [
            "--bootstrap",
            "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRez8iPgVgUa5r7mtRc9soYeqErRv2oe8yKyiXX7jv6s6",
        ]
    line = _error_line(capsys, argv)
    assert problem in line and "65535" in line and "fix the address" in line


@pytest.mark.parametrize(
    "manifest, problem",
    [
        ("[1, 2]", "not a JSON object"),
        ('{"manifest_version": 2, "rank": "x"}', "'rank' must be int"),
        ('{"manifest_version": 2, "lr": true}', "'lr' must be float"),
        ('{"manifest_version": 2, "extra": 3}', "'extra' must be dict"),
        ('{"manifest_version": true}', "no integer manifest_version"),
        ('{"manifest_version": 2.0}', "no integer manifest_version"),
        ('{"manifest_version": 2, "clip": Infinity}', r"clip must be in \(0, 65504\]"),
        ('{"manifest_version": 2, "lr": NaN}', "lr must be a non-negative finite number"),
        ('{"manifest_version": 2, "eps": -1e-3}', "eps must be a positive finite number"),
        ('{"manifest_version": 2, "eps": 1' + "0" * 400 + "}", "eps must be a positive finite"),
        ('{"manifest_version": 2, "eps": 1e-300}', r"eps must be .* in \[1e-06, 1\]"),
        ('{"manifest_version": 2, "rank": 1' + "0" * 30 + "}", r"rank must be 1\.\.4096"),
        ('{"manifest_version": 2, "total_rounds": -1}', "total_rounds must be 0"),
        ('{"manifest_version": 2, "rank": 1' + "0" * 5000 + "}", "not valid JSON"),
        ('{"manifest_version": 2, "extra": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
        ('{"manifest_version": 2, "extra": {"a": ' + "[" * 20 + "]" * 20 + "}}", "deeper than 8"),
        ('{"manifest_version": 2, "extra": {"a": NaN}}', "extra holds a non-finite number"),
        ('{"manifest_version": 2, "base_sha256": "../x"}', "base_sha256 must be empty or 64"),
        ('{"manifest_version": 2, "salt": "' + "x" * 70000 + '"}', "over 65536"),
    ],
)
def test_malformed_manifest_is_one_readable_error(manifest, problem):
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.core.errors import UserError

    with pytest.raises(UserError, match=problem) as info:
        RunConfig.from_json(manifest)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300  # one readable line


def test_train_refuses_the_ledger_of_another_run(capsys, tmp_path):
    args = ["train", "--model", "tiny-llama", "--rounds", "1", "--eval-every", "0"]
    args += ["--eval-examples", "8"]  # the refusal is the point, not the held-out figures
    assert main([*args, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    line = _error_line(capsys, [*args, "--lr", "0.5", "--out", str(tmp_path)])
    assert "holds a ledger of another run" in line and "use another --out" in line


def test_config_file_and_flags_agree(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "tiny-llama"\nrank = 6\nrefresh-period = 7\nlr = 0.002\n'
        "include_embeddings = true\n"
    )
    parser = build_parser()
    from_file = run_config_from_args(parser.parse_args(["train", "--config", str(toml)]))
    from_flags = run_config_from_args(
        parser.parse_args(
            [
                "train",
                "--model",
                "tiny-llama",
                "--rank",
                "6",
                "--refresh-period",
                "7",
                "--lr",
                "0.002",
                "--include-embeddings",
            ]
        )
    )
    assert from_file == from_flags and from_file.run_id == from_flags.run_id
    overridden = run_config_from_args(
        parser.parse_args(["train", "--config", str(toml), "--rank", "3"])
    )
    assert overridden.rank == 3 and overridden.refresh_period == 7  # flags win over the file


def test_bad_flag_exits_with_one_line_from_a_real_process():
    out = subprocess.run(
        [sys.executable, "-m", "seedflood", "train", "--rank", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "argument --rank: invalid int value: 'x'" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["status", "127.0.0.1:1"]])
def test_help_and_status_load_neither_torch_nor_the_daemons(argv):
    # In a fresh interpreter: this test process has long imported torch.
    code = (
        "import sys\n"
        "from seedflood.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = [m for m in ('torch', 'hivemind', 'peer', 'bootstrap') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr


def test_environment_sits_between_the_file_and_the_flags(tmp_path, monkeypatch):
    toml = tmp_path / "run.toml"
    toml.write_text("rank = 6\nrefresh_period = 7\n")
    monkeypatch.setenv("SEEDFLOOD_RANK", "5")
    monkeypatch.setenv("SEEDFLOOD_INCLUDE_EMBEDDINGS", "yes")
    parser = build_parser()
    config = run_config_from_args(parser.parse_args(["train", "--config", str(toml)]))
    assert (config.rank, config.refresh_period, config.include_embeddings) == (5, 7, True)
    flags = parser.parse_args(["train", "--config", str(toml), "--rank", "3"])
    assert run_config_from_args(flags).rank == 3  # flags win over the environment


def test_a_bad_environment_variable_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("SEEDFLOOD_RANK", "eight")
    line = _error_line(capsys, ["eval"])
    assert "environment variable SEEDFLOOD_RANK must be int, got 'eight'" in line


def test_run_settings_written_as_toml_read_back_to_the_same_run(tmp_path):
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.core.flags import to_toml

    config = RunConfig(
        model="tiny-llama", rank=4, lr=2e-3, train_only='q_proj,"odd"\\name', train_norms=True
    )
    toml = tmp_path / "run.toml"
    toml.write_text(to_toml(config))
    back = run_config_from_args(build_parser().parse_args(["train", "--config", str(toml)]))
    assert back == config and back.to_json() == config.to_json()


def test_run_extra_audit_settings_survive_the_toml_a_daemon_is_handed(tmp_path):
    from seedflood_p2p.core.config import RunConfig
    from seedflood_p2p.core.flags import to_toml

    config = RunConfig(model="tiny-llama", extra={"audit": {"lag": 2, "quorum": 2}})
    toml = tmp_path / "run.toml"
    toml.write_text(to_toml(config))
    back = run_config_from_args(build_parser().parse_args(["train", "--config", str(toml)]))
    assert back.extra == config.extra and back.run_id == config.run_id


def test_status_shows_audits():
    from seedflood_p2p.apps.status import format_status

    audits = {"done": 7, "mismatches": 2, "published": 3, "verdicts": 1, "banned": ["12D3x"]}
    text = format_status({"audits": audits})
    assert "audits      done 7  mismatches 2  published 3  verdicts 1  banned 12D3x" in text
    assert "audits" not in format_status({"audits": None})


def test_status_shows_a_late_joiners_trusted_link_and_its_checks():
    from seedflood_p2p.apps.status import format_status

    history = {"trusted_round": 900, "rows": 90_000, "held": 1_200, "checked": False}
    text = format_status({"checkpoint": {"history": history}})
    assert "history     trusted link of round 900: fetching, 1,200 of its 90,000 rows" in text
    history.update(checked=True, match=True)
    check = {"round": 900, "match": False, "offered_by": ["12D3KooWAAAAxxxxyyyy"]}
    text = format_status({"checkpoint": {"history": history, "link_check": check}})
    assert "all 90,000 rows in, as it recorded" in text
    assert "FORGED weights (offered by ..xxxxyyyy): model rebuilt" in text
    assert "history" not in format_status({"checkpoint": {"fetched": None}})


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:99"])
def test_a_device_this_machine_cannot_use_is_one_line(capsys, device):
    import torch

    address = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWHwY64993DfLEQr2QG39nzF48ghhBrhHH6XWNHFtBmDrf"
    if device != "cuda:99":
        problem = "use cpu or cuda (cuda:N picks one of several GPUs)"
    elif torch.cuda.is_available():
        problem = "numbered from 0"
    else:
        problem = "no usable CUDA GPU"
    for argv in (["demo"], ["peer", "--bootstrap", address]):
        line = _error_line(capsys, [*argv, "--device", device])
        assert f"device '{device}'" in line and problem in line, line


def test_simulator_and_demo_settings_load_like_the_others(tmp_path, capsys):
    from seedflood_p2p.sim.simulator import sim_config_from_args

    toml = tmp_path / "sim.toml"
    toml.write_text('topology = "torus"\npeers = 9\nedges_file = ""\nrank = 4\n')
    args = build_parser().parse_args(["simulate", "--config", str(toml), "--delay", "0"])
    sim = sim_config_from_args(args, "dzsgd")
    assert (sim.topology, sim.peers, sim.delay, sim.run.rank) == ("torus", 9, 0, 4)
    assert sim.run.n_ref == 9  # the simulator's own default: every peer counts
    (tmp_path / "typo.toml").write_text('peers = "nine"\n')
    line = _error_line(capsys, ["simulate", "--config", str(tmp_path / "typo.toml")])
    assert "setting 'peers' must be int, got 'nine'" in line
    from seedflood_p2p.apps.demo import DEMO_DEFAULTS
    from seedflood_p2p.core.flags import run_config_from_args

    demo = build_parser().parse_args(["demo"])
    assert run_config_from_args(demo, defaults=DEMO_DEFAULTS).calibration == "content-free"
    (tmp_path / "bad.toml").write_text("minutes = -1\n")
    line = _error_line(capsys, ["demo", "--config", str(tmp_path / "bad.toml")])
    assert "--minutes > 0" in line


def test_the_demo_trains_the_default_models_upper_blocks_and_all_of_another(tmp_path, monkeypatch):
    from seedflood_p2p.apps.demo import demo_defaults
    from seedflood_p2p.core.flags import run_config_from_args

    def config(*argv: str):
        args = build_parser().parse_args(["demo", *argv])
        return run_config_from_args(args, defaults=demo_defaults(args))

    default = config()
    assert (default.model, default.train_only, default.train_examples) == (
        "smollm2-135m",
        "model.layers.2[89].*",
        512,
    )
    assert (default.basis, default.directions, default.step_rule) == ("kfac", 16, "round_mean")
    flags_win = config("--train-examples", "0", "--train-only", "")
    assert (flags_win.train_only, flags_win.train_examples) == ("", 0)
    other = config("--model", "tiny-llama", "--dataset", "synthetic-sentiment")
    assert (other.train_only, other.train_examples, other.basis) == ("", 0, "kfac")
    (tmp_path / "run.toml").write_text('model = "tiny-llama"\n')
    assert config("--config", str(tmp_path / "run.toml")).train_only == ""
    # the fast setting follows the model to another data set (issue 47)
    assert config("--dataset", "synthetic-sentiment").train_examples == 512
    monkeypatch.setenv("SEEDFLOOD_MODEL", "tiny-llama")
    assert config().train_only == ""


def test_peer_bootstrap_list_from_toml_and_a_flag_replaces_it(tmp_path, capsys):
    from peer.command import settings_from_args

    a = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWA"
    b = "/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWB"
    toml = tmp_path / "peer.toml"
    toml.write_text(f'bootstrap = ["{a}", "{b}"]\ndiscovery_interval = 5.0\n')
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["peer", "--config", str(toml)]))
    assert settings.bootstrap == [a, b]
    assert settings.node.discovery and settings.node.discovery_interval == 5.0
    flagged = parser.parse_args(["peer", "--config", str(toml), "--bootstrap", b])
    assert settings_from_args(flagged).bootstrap == [b]
    toml.write_text(f'bootstrap = "{a}"\n')  # a string, not a list: one readable line
    line = _error_line(capsys, ["peer", "--config", str(toml)])
    assert "bootstrap" in line and "list" in line


def test_pydantic_settings_loads_every_source_with_one_precedence(tmp_path, monkeypatch, capsys):
    """One value from the file, the environment or a flag gives the same settings; given by
    several, the flag wins over the environment, over the file, over the default."""
    import pydantic_settings

    from peer.command import PEER_FIELDS, settings_from_args
    from seedflood_p2p.core import flags

    assert issubclass(flags._model(tuple(PEER_FIELDS)), pydantic_settings.BaseSettings)
    parser = build_parser()

    def load(command, name, flag=None, env=None, file=None):
        """`command`'s settings with setting `name` given by a flag, env and/or file."""
        argv = [command] + ([f"--{name.replace('_', '-')}", flag] if flag else [])
        monkeypatch.delenv(f"SEEDFLOOD_{name.upper()}", raising=False)
        if env:
            monkeypatch.setenv(f"SEEDFLOOD_{name.upper()}", env)
        if file:
            (tmp_path / "s.toml").write_text(f"{name} = {file}\n")
            argv += ["--config", str(tmp_path / "s.toml")]
        args = parser.parse_args(argv)
        return settings_from_args(args) if command == "peer" else run_config_from_args(args)

    for command, name, default in [("peer", "round_deadline", 30.0), ("eval", "rank", 8)]:
        assert getattr(load(command, name), name) == default
        same = [load(command, name, flag="5"), load(command, name, env="5")]
        assert same[0] == same[1] == load(command, name, file="5")
        assert getattr(same[0], name) == 5
        assert getattr(load(command, name, flag="3", env="2", file="1"), name) == 3
        assert getattr(load(command, name, env="2", file="1"), name) == 2
        assert getattr(load(command, name, file="1"), name) == 1
    # pydantic's checks, whatever the source: types, bounds, choices
    monkeypatch.setenv("SEEDFLOOD_ROUND_DEADLINE", "-1")
    assert "'round_deadline' must be seconds, from 0" in _error_line(capsys, ["peer"])
    monkeypatch.delenv("SEEDFLOOD_ROUND_DEADLINE")
    (tmp_path / "c.toml").write_text('reachability = "privat"\n')
    line = _error_line(capsys, ["peer", "--config", str(tmp_path / "c.toml")])
    assert "setting 'reachability' must be one of 'auto', 'private', 'public'" in line
    (tmp_path / "i.toml").write_text("lr = 1\n")  # an int stays an int, as it always did:
    config = run_config_from_args(parser.parse_args(["eval", "--config", str(tmp_path / "i.toml")]))
    assert '"lr":1,' in config.to_json()  # so the run id of such a file is unchanged
