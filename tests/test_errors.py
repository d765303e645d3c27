"""The failures volunteers hit most, provoked for real, each ending in one line that says
what is wrong and what to do."""

import socket
import subprocess
import time

import pytest

from harness.cluster import RUN, run_toml, start_bootstrap
from peer.daemon import MAX_CLOCK_SKEW, check_manifest_reply
from seedflood.cli import build_parser, main
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import run_config_from_args
from seedflood_p2p.network.transport.identity import load_or_create_identity
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


def _peer_error(capsys, *args: str) -> str:
    assert main(["peer", "--listen", "/ip4/127.0.0.1/tcp/0", *args]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_bootstrap_lists_addresses_and_how_to_check(capsys, tmp_path):
    peer_id = load_or_create_identity(tmp_path / "other.key").to_base58()
    address = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{peer_id}"
    line = _peer_error(
        capsys,
        *("--bootstrap", address, "--data-dir", str(tmp_path / "p")),
        *("--connect-retries", "1", "--redial-min", "0.2"),  # two rounds of dials
    )
    assert line.startswith("error: could not reach any bootstrap peer or known peer after 2")
    tried = address.rsplit("/p2p/", 1)[0]
    assert tried in line and "nc -vz 127.0.0.1" in line and "reachable" in line


def test_port_already_in_use(capsys, tmp_path):
    peer_id = load_or_create_identity(tmp_path / "other.key").to_base58()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert (
            main(
                [
                    "peer",
                    "--listen",
                    f"/ip4/127.0.0.1/tcp/{port}",
                    "--bootstrap",
                    f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}",
                    "--data-dir",
                    str(tmp_path / "p"),
                ]
            )
            == 2
        )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(port) in line and "in use" in line


@pytest.fixture(scope="module")
def wrong_base_bootstrap(tmp_path_factory):
    """A bootstrap whose stored manifest names base weights nobody has."""
    work = tmp_path_factory.mktemp("wrong-base")
    config = RUN.replace(base_sha256="0" * 64)
    (work / "bootstrap").mkdir()
    with Ledger(work / "bootstrap" / "ledger.sqlite", config.run_id) as ledger:
        ledger.claim(config, "")
    proc, address = start_bootstrap(work)
    yield address
    proc.stop()


@pytest.mark.slow
def test_base_weights_hash_mismatch(capsys, tmp_path, wrong_base_bootstrap):
    line = _peer_error(
        capsys, "--bootstrap", wrong_base_bootstrap, "--data-dir", str(tmp_path / "p")
    )
    assert "base weights of 'tiny-llama'" in line and "the run expects 0000000000000000" in line
    assert "delete the cached copy" in line


@pytest.mark.slow
def test_data_dir_of_another_run(capsys, tmp_path, wrong_base_bootstrap):
    other = RUN.replace(lr=0.5)
    (tmp_path / "p").mkdir()
    with Ledger(tmp_path / "p" / "ledger.sqlite", other.run_id) as ledger:
        ledger.claim(other, "")
    line = _peer_error(
        capsys, "--bootstrap", wrong_base_bootstrap, "--data-dir", str(tmp_path / "p")
    )
    assert f"holds a ledger of another run ({other.run_id[:12]})" in line
    assert "use a new --data-dir" in line


def test_clock_and_version_mismatch_with_the_run():
    manifest = run_config_from_args(build_parser().parse_args(["bootstrap"])).to_json()
    now = time.time()
    reply = {"manifest": manifest, "version": "0.1.0", "time": now}
    assert check_manifest_reply(reply, now + 5, "0.1.3").run_id  # small skew, patch version: ok
    with pytest.raises(UserError, match=r"clock differs .* by -\d+ s: enable time sync"):
        check_manifest_reply(reply, now + MAX_CLOCK_SKEW + 60, "0.1.0")
    with pytest.raises(UserError, match=r"run uses seedflood-p2p 0.1.0, this is 0.2.0.*install"):
        check_manifest_reply(reply, now, "0.2.0")
    with pytest.raises(UserError, match="manifest version 99 is not supported"):
        check_manifest_reply(
            {
                **reply,
                "manifest": manifest.replace('"manifest_version":2', '"manifest_version":99'),
            },
            now,
            "0.1.0",
        )


def test_disk_full_while_writing_the_ledger(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    ok = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        == 0
    )
    if not ok:
        pytest.skip("needs root to mount a tiny tmpfs (CI runs as root)")
    try:
        ledger = Ledger(mount / "ledger.sqlite", "run")
        with pytest.raises(UserError, match="disk full while writing ledger .* free space"):
            for t in range(100_000):
                ledger.add([UpdateMessage(t, bytes([p]) * 38, (0.5,)) for p in range(8)])
        kept = len(ledger)
        assert kept > 0
        ledger.close()
        with Ledger(mount / "ledger.sqlite", "run") as again:  # nothing committed was lost
            assert len(again) == kept
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_bootstrap_restarted_with_other_settings_names_the_ones_that_differ(capsys, tmp_path):
    from bootstrap.node import BootstrapSettings, resolve_manifest

    run = RUN.replace(base_sha256="0" * 64, dataset_sha256="1" * 64)
    data = tmp_path / "boot"
    data.mkdir()
    with Ledger(data / "ledger.sqlite", run.run_id) as ledger:
        ledger.claim(run, "")
    argv = ["bootstrap", "--data-dir", str(data), "--config", str(run_toml(tmp_path))]
    assert main([*argv, "--basis", "activation", "--directions", "8"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: {data} already serves run {run.run_id[:12]}"), line
    assert "directions: run's 1, given 8; basis: run's 'random', given 'activation'" in line
    assert "start with the run's settings" in line
    # with the run's own settings it is the same run again (the hashes come from its ledger)
    config = run_config_from_args(build_parser().parse_args(argv))
    assert resolve_manifest(BootstrapSettings(data_dir=data), config) == run
