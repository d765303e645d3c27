"""The learning settings a new run gets when it names none (NEW_RUN_DEFAULTS), and what a
bootstrap node says when restarted with settings other than its stored run's."""

from seedflood_p2p.apps.cli import build_parser, main
from seedflood_p2p.core.config import NEW_RUN_DEFAULTS, RunConfig
from seedflood_p2p.core.flags import run_config_from_args
from seedflood_p2p.storage.ledger import Ledger


def test_a_bootstrap_without_run_flags_makes_a_run_with_the_new_run_defaults():
    args = build_parser().parse_args(["bootstrap", "--model", "tiny-llama"])
    config = run_config_from_args(args, defaults=NEW_RUN_DEFAULTS)
    assert config.basis == "activation" and config.directions == 16
    assert (config.step_rule, config.n_ref, config.lr, config.rank) == ("round_mean", 16, 0.064, 32)
    # RunConfig's own defaults are unchanged: a manifest that leaves a field out keeps
    # meaning what it meant when it was written
    assert RunConfig.from_json(RunConfig().to_json()).basis == "random"
    assert RunConfig().step_rule == "per_update" and RunConfig().directions == 1


def test_a_restart_with_other_settings_names_the_ones_that_differ(capsys, tmp_path):
    old = RunConfig(rank=32, lr=4e-3, base_sha256="0" * 64, dataset_sha256="1" * 64)
    data = tmp_path / "boot"
    data.mkdir()
    with Ledger(data / "ledger.sqlite", old.run_id) as ledger:
        ledger.set_meta("manifest", old.to_json())
    # the run was made with the settings before NEW_RUN_DEFAULTS; restarted without flags
    assert main(["bootstrap", "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {data} already serves run {old.run_id[:12]}"), line
    assert "basis: run's 'random', given 'activation'" in line
    assert "directions: run's 1, given 16" in line
    assert "start with the run's settings" in line
    # with the run's own settings it is the same run again
    argv = ["bootstrap", "--data-dir", str(data), "--basis", "random", "--directions", "1"]
    argv += ["--step-rule", "per_update", "--n-ref", "1", "--lr", "4e-3"]
    args = build_parser().parse_args(argv)
    from bootstrap.node import BootstrapSettings, resolve_manifest

    config = run_config_from_args(args, defaults=NEW_RUN_DEFAULTS)
    assert resolve_manifest(BootstrapSettings(data_dir=data), config) == old
