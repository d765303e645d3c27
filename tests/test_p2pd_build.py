"""Our p2pd build (network/transport/p2pd_build.py): made from hivemind's bundled binary,
it holds exactly the settings asked for and nothing else changed; anything it does not
know is refused with a line that says what. That the build runs and relays only through
the configured relay: tests/test_relay.py."""

import shutil

import pytest

from seedflood_p2p.network.transport.p2pd import bundled_p2pd
from seedflood_p2p.network.transport.p2pd_build import (
    GOSSIPSUB_DEFAULTS,
    IMAGE,
    BuildError,
    MeshSettings,
    build,
    file_offset,
    patch_image,
    patches,
)

ODD = MeshSettings(
    degree=10,
    history=8,
    gossip_factor=0.1,
    seen_ttl=30.0,
    validation_queue=1024,
    subscription_buffer=4096,
    inbound_queue=512,
    outbound_queue=256,
)


def test_a_build_holds_its_settings_at_each_patch_and_differs_nowhere_else(tmp_path):
    plain = build(bundled_p2pd(), GOSSIPSUB_DEFAULTS, tmp_path).read_bytes()
    odd_path = build(bundled_p2pd(), ODD, tmp_path)
    odd = odd_path.read_bytes()
    assert odd_path.name == "p2pd" and len(odd) == len(plain) > 20_000_000
    patched = set()
    for p in patches(ODD):
        end = file_offset(odd, p.address) + len(p.expected)
        assert odd[end - len(p.value) : end] == p.value, p.name
        patched.update(range(end - len(p.value), end))
    differ = {i for i in patched if odd[i] != plain[i]}
    assert differ and all(odd[i] == plain[i] for i in range(len(odd)) if i not in patched)
    # GossipSub's own settings' build differs from the unpacked binary in the relay jump
    relay = next(p for p in patches(GOSSIPSUB_DEFAULTS) if p.name.startswith("EnableRelayV2"))
    at = file_offset(plain, relay.address) + len(relay.expected) - 1
    assert plain[at] == 0xEB and relay.expected[-1] == 0x74
    assert build(bundled_p2pd(), ODD, tmp_path) == odd_path  # cached: the same file


def test_a_p2pd_this_build_does_not_know_is_refused_with_its_digest(tmp_path):
    other = tmp_path / "p2pd"
    shutil.copy(bundled_p2pd(), other)
    with open(other, "r+b") as f:
        f.seek(1000)
        f.write(b"\0")
    with pytest.raises(BuildError, match="is not the p2pd this build knows"):
        build(other, MeshSettings(), tmp_path / "cache")


def test_bytes_not_where_a_patch_expects_them_stop_the_build():
    image = bytearray(IMAGE[1] - IMAGE[0])
    with pytest.raises(BuildError, match=r"p2pd at 0x1c68780 \(GossipSubD\) holds 00"):
        patch_image(image, IMAGE[0], MeshSettings())


@pytest.mark.parametrize(
    "settings, why",
    [
        (MeshSettings(degree=2), "gossip degree 2"),
        (MeshSettings(history=2), "gossip history 2"),
        (MeshSettings(seen_ttl=0.5), "seen-message TTL"),
        (MeshSettings(gossip_factor=1.5), "gossip factor 1.5"),
        (MeshSettings(subscription_buffer=0), "subscription_buffer 0"),
    ],
)
def test_settings_outside_gossipsubs_bounds_are_refused(settings, why):
    with pytest.raises(ValueError, match=why):
        settings.check()


def test_node_settings_name_the_build_a_daemon_runs():
    from seedflood_p2p.network.settings import NodeSettings

    settings = NodeSettings(gossip_degree=8, seen_ttl=60.0, subscription_buffer=4096)
    assert settings.mesh() == MeshSettings(degree=8, seen_ttl=60.0, subscription_buffer=4096)
    assert NodeSettings().mesh() == MeshSettings()  # the same defaults: larger queues
    assert NodeSettings(p2pd="bundled", gossip_degree=8).mesh() is None  # hivemind's as is
