"""An open run's creator names its own peers as founders from the command line
(`seedflood id`, `seedflood bootstrap --founders`), and is told when a run has no probation."""

import pytest

from bootstrap.command import with_founders
from bootstrap.node import open_run_warning
from seedflood.cli import main
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.transport.identity import load_or_create_identity

RUN = RunConfig(model="tiny-llama", dataset="synthetic-sentiment")


def _id(capsys, data_dir) -> str:
    assert main(["id", "--data-dir", str(data_dir)]) == 0
    return capsys.readouterr().out.strip()


def test_seedflood_id_prints_the_key_a_peer_signs_with_and_keeps_it(capsys, tmp_path):
    first = _id(capsys, tmp_path / "peer-a")  # the directory does not exist yet
    assert first.startswith("12D3KooW")
    assert _id(capsys, tmp_path / "peer-a") == first  # the same key, not a new one
    assert load_or_create_identity(tmp_path / "peer-a" / "identity.key").to_base58() == first
    assert _id(capsys, tmp_path / "peer-b") != first


def test_founders_flag_puts_every_other_identity_on_probation(capsys, tmp_path):
    a, b = _id(capsys, tmp_path / "a"), _id(capsys, tmp_path / "b")
    config = with_founders(RUN, f"{a}, {b}")
    assert config.extra["probation"]["founders"] == [a, b]
    probation = config.probation
    founders = {load_or_create_identity(tmp_path / n / "identity.key").to_bytes() for n in "ab"}
    assert probation.enabled and probation.founders == founders
    assert config.run_id != RUN.run_id  # the founders are part of the run's identity
    # other probation settings from the config file are kept
    tuned = RUN.replace(extra={"probation": {"vouches": 5}})
    assert with_founders(tuned, a).probation.vouches == 5
    assert with_founders(RUN, None) == RUN


@pytest.mark.parametrize(
    "founders, extra, problem",
    [
        ("not-a-peer-id", {}, "extra.probation: founders"),
        (" , ", {}, "--founders is empty"),
        ("X", {"probation": {"founders": []}}, "both set probation"),
        ("X", {"probation": False}, "both set probation"),
        ("X", {"probation": 3}, "must be false or a table"),
    ],
)
def test_bad_founders_are_one_line(capsys, tmp_path, founders, extra, problem):
    peer = _id(capsys, tmp_path / "p")
    with pytest.raises(UserError, match=problem):
        with_founders(RUN.replace(extra=extra), founders.replace("X", peer))


def test_bootstrap_with_a_bad_founder_stops_at_start_with_one_line(capsys, tmp_path):
    argv = ["bootstrap", "--model", "tiny-llama", "--dataset", "synthetic-sentiment"]
    argv += ["--data-dir", str(tmp_path / "boot"), "--founders", "12D3KooWnope"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: run setting extra.probation: founders")
    assert not (tmp_path / "boot").exists()  # refused before anything was written


def test_an_open_run_without_founders_is_told_what_it_risks(capsys, tmp_path):
    warning = open_run_warning(RUN)
    assert "no probation (it names no founders)" in warning and "--founders" in warning
    off = open_run_warning(RUN.replace(extra={"probation": False}))
    assert "extra.probation = false" in off
    assert open_run_warning(with_founders(RUN, _id(capsys, tmp_path / "f"))) is None
    creator = _id(capsys, tmp_path / "creator")
    ticketed = RUN.replace(extra={"join": {"mode": "ticketed", "creator": creator}})
    assert open_run_warning(ticketed) is None  # the creator picks who joins
