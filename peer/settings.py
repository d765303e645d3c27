"""The peer daemon's settings (flags, TOML keys, SEEDFLOOD_* variables): `PeerSettings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from seedflood_p2p.core.flags import MAX_INT, MAX_SECONDS, bounded
from seedflood_p2p.network.settings import NodeSettings


# Frozen once loaded: a setting the run overrides (the ticket's end round, the staleness
# audits allow) makes a new PeerSettings (dataclasses.replace), so every reader sees one.
@dataclass(frozen=True)
class PeerSettings:
    bootstrap: list[str] = field(default_factory=list)  # full multiaddrs of bootstrap nodes
    # a new peer gives up after this many rounds of dials (backoff)
    connect_retries: int = bounded(5, 0, 1 << 20, "a number of attempts (0: once)")
    data_dir: Path = Path("seedflood-peer")
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    # rounds to train, then leave
    until_round: int = bounded(0, 0, MAX_INT, "a round (0: the run's total_rounds, or never)")
    # may start round t once live peers published t - 1 - this
    max_staleness: int = bounded(2, 0, MAX_INT, "a number of rounds")
    # seconds to wait for slow peers before going on (once: a peer that made us wait it out
    # is not waited for again until it keeps pace)
    round_deadline: float = bounded(30.0, 0, MAX_SECONDS, "seconds")
    # a peer unheard this long is not waited for
    liveness_timeout: float = bounded(60.0, 0, MAX_SECONDS, "seconds")
    # wait (up to startup_wait) for this many topic peers before round 1
    min_peers: int = bounded(0, 0, 1 << 20, "a number of peers")
    startup_wait: float = bounded(30.0, 0, MAX_SECONDS, "seconds")
    # minimum seconds per round (pacing for demos and tests)
    round_interval: float = bounded(0.0, 0, MAX_SECONDS, "seconds")
    # after the last round: quiet this long, stragglers done, or give up after linger_max
    linger: float = bounded(5.0, 0, MAX_SECONDS, "seconds")
    linger_max: float = bounded(120.0, 0, MAX_SECONDS, "seconds")
    eval_every: int = bounded(0, 0, MAX_INT, "a number of rounds (0: never)")
    eval_examples: int = bounded(200, 1, 1 << 30, "a number of examples")
    metrics_host: str = "127.0.0.1"
    # None: no HTTP endpoint
    metrics_port: int | None = bounded(None, 0, 65535, "a TCP port (0: any free port)")
    # also serve the run page (GET /run, /run.json) on the metrics server, as this peer sees
    # the run: its ledger, its observations, its own losses and evaluations
    run_page: bool = False
    device: str = "cpu"
    # This machine's copy of the run's model directory / data file, for a run whose
    # manifest names a path of the organiser's machine (never opened here); each is
    # checked against the manifest's base_sha256 / dataset_sha256.
    model_dir: Path | None = None
    dataset_file: Path | None = None
    # A run that trains upper blocks only (train_only): MB of training examples' hidden
    # states at the first trained block kept, so a recurring example skips the frozen
    # blocks (the held-out examples are kept apart, all of them); 0: keep none
    prefix_cache_mb: int = bounded(64, 0, 1 << 20, "MB (0: keep none)")
    # torch threads for this peer (0: torch's default, all cores)
    threads: int = bounded(0, 0, 4096, "a number of threads (0: torch's default)")
    # A ticketed run: this peer's join ticket from the run creator (`seedflood ticket`,
    # base58); its updates count in rounds below the ticket's end round
    ticket: str = ""
    # Late join: fetch a checkpoint of the run's chain from peers instead of
    # replaying the rows it covers: "auto" when the download (at checkpoint_bandwidth Mbit/s)
    # is estimated faster than the replay, "always", or "never".
    checkpoint_fetch: str = field(default="auto", metadata={"choices": ("auto", "always", "never")})
    # Late join in a run with a checkpoint chain: "first" syncs and checks the whole
    # history before training; "background" trusts the rows of the link a quorum of peers
    # offers, is ready once it holds the rows after it, and fetches and checks the history
    # while it trains (peer/latejoin.py)
    history_sync: str = field(default="first", metadata={"choices": ("first", "background")})
    # Mbit/s this peer expects to download at
    checkpoint_bandwidth: float = bounded(100.0, 0, 1e9, "Mbit/s", open_low=True)
    # build chain link R once the own round is R + this
    checkpoint_settle: int = bounded(32, 0, MAX_INT, "a number of rounds")
    node: NodeSettings = field(default_factory=NodeSettings)
