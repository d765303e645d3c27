"""`seedflood doctor`: each check finds what it names, against a real bootstrap node."""

from __future__ import annotations

import json
import socket

import pytest

from harness.cluster import start_bootstrap
from seedflood.cli import main


def doctor(capsys, *args: str) -> tuple[int, dict[str, list[dict]]]:
    code = main(["doctor", "--json", "--timeout", "20", *args])
    checks: dict[str, list[dict]] = {}
    for check in json.loads(capsys.readouterr().out):
        checks.setdefault(check["name"], []).append(check)
    return code, checks


def test_offline_checks_name_the_problem_and_the_fix(tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    try:
        code, checks = doctor(
            capsys, "--data-dir", str(not_a_dir), "--listen", f"/ip4/127.0.0.1/tcp/{port}"
        )
    finally:
        taken.close()
    assert code == 1
    assert checks["p2pd"][0]["status"] == "ok"
    assert "our build: " in checks["p2pd"][0]["detail"]  # network/transport/p2pd_build.py
    assert checks["listen"][0]["status"] == "fail"
    assert "already in use" in checks["listen"][0]["detail"]
    assert checks["data dir"][0]["status"] == "fail"
    assert checks["data dir"][0]["fix"]
    assert checks["bootstrap"][0]["status"] == "warn"  # none given


def test_bad_identity_key_and_unreachable_bootstrap_fail(tmp_path, capsys):
    data = tmp_path / "peer"
    data.mkdir()
    key = data / "identity.key"
    key.write_bytes(b"not a key")
    key.chmod(0o600)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    address = (
        f"/ip4/127.0.0.1/tcp/{closed}/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    )
    code, checks = doctor(
        capsys, "--data-dir", str(data), "--bootstrap", address, "--bootstrap", "not-an-address"
    )
    assert code == 1
    assert checks["identity"][0]["status"] == "fail"
    assert "not a libp2p private key" in checks["identity"][0]["detail"]
    statuses = [c["status"] for c in checks["bootstrap"]]
    assert statuses == ["fail", "fail"]
    assert f"127.0.0.1:{closed}" in checks["bootstrap"][0]["detail"]


@pytest.mark.slow
def test_a_live_bootstrap_node_serves_its_manifest_and_clock(tmp_path, capsys):
    boot, address = start_bootstrap(tmp_path)
    try:
        code, checks = doctor(capsys, "--data-dir", str(tmp_path / "peer"), "--bootstrap", address)
    finally:
        boot.stop()
    assert code == 0, checks
    assert checks["bootstrap"][0]["status"] == "ok"
    assert "tiny-llama" in checks["bootstrap"][0]["detail"]
    assert checks["clock"][0]["status"] == "ok"  # same machine: no skew
    assert checks["reachable"][0]["status"] == "warn"  # loopback only: not public
    # the bootstrap node serves a relay, but a loopback relay address is never announced
    assert checks["relay"][0]["status"] == "warn", checks["relay"]
