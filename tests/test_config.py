"""RunConfig: one parse into frozen, typed settings; run ids that never move; a strict
manifest from the network."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from harness.cluster import RUN
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import AuditSettings, JoinSettings

ROOT = Path(__file__).resolve().parent.parent
FOUNDER = "12D3KooWMW5GCRKWgP6Hj3VLdVYAm3tmKHgwyZhCc3TUj5AUvfFx"
# A manifest of before `normalize` (and the settings added later) existed.
OLD_MANIFEST = (
    '{"manifest_version":2,"model":"tiny-llama","dataset":"synthetic-sentiment",'
    '"text_column":"text","label_column":"label","max_length":64,"batch_size":16,"rank":8,'
    '"refresh_period":20,"eps":0.001,"directions":1,"train_norms":false,"train_only":"",'
    '"lr":0.002,"lr_schedule":"constant","total_rounds":0,"clip":100.0,"n_ref":1,'
    '"include_embeddings":false,"estimator":"subcge","salt":"seedflood","base_sha256":"",'
    '"extra":{}}'
)


def _deploy_config() -> RunConfig:
    """The run settings of deploy/config/bootstrap.toml."""
    table = tomllib.loads((ROOT / "deploy/config/bootstrap.toml").read_text())
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in table.items() if k in names})


def _manifests() -> dict[str, RunConfig]:
    deploy = _deploy_config()
    return {
        "default": RunConfig(),
        "cluster_run": RUN,
        "deploy_bootstrap_toml": deploy,
        "deploy_with_base": deploy.replace(base_sha256="ab" * 32, dataset_sha256="cd" * 32),
        "audit_off": RunConfig(extra={"audit": False}),
        "audit_on": RunConfig(extra={"audit": True}),
        "audit_table": RunConfig(model="tiny-llama", extra={"audit": {"lag": 2, "quorum": 2}}),
        "audit_cpu": dataclasses.replace(RUN, extra={"audit": {"cpu_share": 1.0}}),
        "audit_disabled_table": RunConfig(extra={"audit": {"enabled": False}}),
        "checkpoint_chain": dataclasses.replace(RUN, extra={"checkpoint_every": 8, "audit": False}),
        "probation_founders": RunConfig(
            extra={"probation": {"founders": [FOUNDER], "vouches": 5, "share": 0.5}}
        ),
        "probation_off": RunConfig(extra={"probation": False}, allow_peers=[FOUNDER]),
        "join_ticketed": RunConfig(extra={"join": {"mode": "ticketed", "creator": FOUNDER}}),
        "fuzz_salt": RunConfig(salt="fuzz"),
        "kfac_task": RunConfig(
            model="smollm2-135m",
            dataset="mr",
            basis="kfac",
            directions=16,
            batch_size=16,
            train_only="model.layers.2[89].*",
            step_rule="round_mean",
            calibration="content-free",
            task="sentiment",
            label_words=[" terrible", " great"],
            train_examples=512,
        ),
        "free_form_extra": RunConfig(extra={"note": "x", "n": [1, 2.5, None, True]}),
        "old_manifest_no_normalize": RunConfig.from_json(OLD_MANIFEST),
    }


# Compatibility anchors: the run ids these manifests had before the settings became typed
# (computed on that code). A run id is what every peer of a run agrees on; none may move.
PINNED_RUN_IDS = {
    "default": "386a14a517907ac3458f33e6fe06df1a807b4a94ada46527782bf1c0d61a78b2",
    "cluster_run": "0064a188b53a7c5038b8c248c6a26440295c5546a5d620faf0ce89c5d7aaf90f",
    "deploy_bootstrap_toml": "b90fe07fbea1c8086c24ff8c1fbe607b8d188b243f6238a7549a8234b11bfcf6",
    "deploy_with_base": "e2dc33c4c2e6ad9f534e49ba00acb93909c64110d0e477e801362cd895e15446",
    "audit_off": "c10834788807336b0bbd6aaf9bf44efc31b8f4707cef4a77b49e7737a9505629",
    "audit_on": "23d188b7f43eeca00c470c30cd271d638834c7c19147524bd78515814c2ff0c0",
    "audit_table": "0b49c2f37808b41b1d4a9310fe01c415e24aec5dd1161b36630e419811bdd751",
    "audit_cpu": "a078a24288f4c74d3ffa676673bbc18dad5e82fbe59867121442a6b8eafc5739",
    "audit_disabled_table": "440c8bf0e0b387b363a850cea74634de6e2ff57353997b7a3d0ed39f85b5ddc2",
    "checkpoint_chain": "1fad44855d5b1e238dc64958b59c732bfcca34693eda50faa8dd15044c4faac7",
    "probation_founders": "1113c5545c855245bf02f4b2a1b42da381317dc6880dee867bf4fa050af38337",
    "probation_off": "66fc4581131ff69e0b07dc1638a110a66c3e10af7f8ee4302954c902b0a3b7aa",
    "join_ticketed": "7835cf19e957ad9c568bdea2e3aa308730f13b780d9592ab9b1b8ded05b89331",
    "fuzz_salt": "3953fbbc47f096cf55ea5a03d680ca9e9323c5313e31acf26f15a5f99fbacb82",
    "kfac_task": "296cc36e0ab59854536b927e03d6f259805900939ef0f081acb84a1d52208a0b",
    "free_form_extra": "a02388a33cab8a409f40869c05133b044aa6774115931d4f92e02a1b28512f95",
    "old_manifest_no_normalize": "8352ffe504b36ce0df3a63a18d7f2fcfb324243127f42f8ccd2393d24a46b189",
}
PINNED_DEFAULT_MANIFEST = (
    '{"base_sha256":"","batch_size":16,"clip":100.0,"dataset":"synthetic-sentiment",'
    '"directions":1,"eps":0.001,"estimator":"subcge","extra":{},"include_embeddings":false,'
    '"label_column":"label","lr":0.004,"lr_schedule":"constant","manifest_version":2,'
    '"max_length":64,"model":"tiny-llama","n_ref":1,"normalize":"unit","rank":8,'
    '"refresh_period":20,"salt":"seedflood","text_column":"text","total_rounds":0,'
    '"train_norms":false,"train_only":""}'
)


def test_run_ids_of_existing_manifests_do_not_move():
    manifests = _manifests()
    assert set(manifests) == set(PINNED_RUN_IDS)
    for name, config in manifests.items():
        assert config.run_id == PINNED_RUN_IDS[name], name
        again = RunConfig.from_json(config.to_json())  # and they load back to themselves
        assert again == config and again.run_id == config.run_id, name
    assert RunConfig().to_json() == PINNED_DEFAULT_MANIFEST


def test_extra_sections_are_typed_once_at_construction():
    config = RunConfig(
        extra={
            "audit": {"lag": 2, "quorum": 2},
            "probation": {"founders": [FOUNDER], "vouches": 5},
            "checkpoint_every": 8,
            "join": {"mode": "ticketed", "creator": FOUNDER},
        }
    )
    assert config.audit == AuditSettings(enabled=True, lag=2, quorum=2)
    assert config.probation.enabled and config.probation.vouches == 5
    assert config.checkpoint_every == 8
    assert config.join.mode == "ticketed" and config.join.creator is not None
    assert RunConfig().audit.enabled and RunConfig().audit.lag == 3  # audits on by default
    assert RunConfig().join == JoinSettings() and RunConfig().checkpoint_every == 0
    assert config.audit is config.audit and config.run_key is config.run_key  # computed once
    # a bad section refuses the settings when they are built, naming the setting
    for extra, named in [
        ({"audit": {"lag": -1}}, "extra.audit: lag"),
        ({"audit": {"lag": True}}, "extra.audit: lag"),
        ({"audit": {"cpu_share": 1e9}}, "extra.audit: cpu_share"),
        ({"probation": {"share": 0}}, "extra.probation: share"),
        ({"checkpoint_every": -3}, "extra.checkpoint_every"),
        ({"checkpoint_every": 1 << 50}, "extra.checkpoint_every"),
        ({"join": {"mode": "ticketed", "creator": "x"}}, "extra.join.creator"),
    ]:
        with pytest.raises(UserError, match=named):
            RunConfig(extra=extra)


def test_settings_are_frozen():
    extra = {"audit": {"lag": 2}}
    peers = [FOUNDER]
    config = RunConfig(extra=extra, allow_peers=peers)
    run_id = config.run_id
    extra["audit"]["lag"] = 5  # the caller's dict and list are not the config's
    peers.append("x")
    assert config.audit.lag == 2 and config.allow_peers == [FOUNDER]
    assert (
        config.run_id
        == run_id
        == RunConfig(extra={"audit": {"lag": 2}}, allow_peers=[FOUNDER]).run_id
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "change, named",
    [
        ({"lr": 11.0}, "lr must be a non-negative finite number at most 10"),
        ({"lr": -1e-3}, "lr must be"),
        ({"eps": 2.0}, "eps must be"),
        ({"clip": 1e6}, "clip must be"),
        ({"rank": 0}, "rank must be"),
        ({"basis_damping": 0.0}, "basis_damping must be"),
        ({"basis_fisher_power": 2.0}, "basis_fisher_power must be"),
        ({"train_examples": -1}, "train_examples must be"),
    ],
)
def test_numbers_outside_their_bounds_are_one_line_naming_the_field(change, named):
    body = {**json.loads(RunConfig().to_json()), **change}
    with pytest.raises(UserError, match=named) as caught:
        RunConfig.from_json(json.dumps(body))
    assert "\n" not in str(caught.value)


def _network(**changes) -> str:
    body = {**json.loads(RunConfig().to_json()), **changes}
    return json.dumps(body)


def test_a_hostile_manifest_from_the_network_is_refused():
    digests = {"base_sha256": "ab" * 32, "dataset_sha256": "cd" * 32}
    for text, named in [
        (_network(dataset="/etc/passwd"), "dataset '/etc/passwd' is a path"),
        (_network(dataset="../../etc/passwd", **digests), "dataset '../../etc/passwd'"),
        (_network(model="~/.ssh/id_ed25519", **digests), "model '~/.ssh/id_ed25519'"),
        (_network(model="/home/org/model"), "no base_sha256"),
        (_network(dataset="data/../../x.csv", **digests), "climbs"),
        (_network(lr=1e300), "lr must be"),
        (_network(eps=0.0), "eps must be"),
        (_network(extra={"audit": {"quorum": 10**9}}), "extra.audit: quorum"),
        (_network(extra={"checkpoint_every": "x"}), "extra.checkpoint_every"),
    ]:
        with pytest.raises(UserError, match=named) as caught:
            RunConfig.from_network(text)
        assert "\n" not in str(caught.value), text
    # the organiser's own files travel by digest: a plain path with its digest is fine,
    # and so are built-in names and hub ids
    organiser = RunConfig.from_network(_network(dataset="/srv/org/nli.csv", **digests))
    assert organiser.dataset == "/srv/org/nli.csv"
    assert RunConfig.from_network(_network(model="HuggingFaceTB/SmolLM2-135M")) is not None
    assert RunConfig.from_network(RunConfig().to_json()) == RunConfig()
