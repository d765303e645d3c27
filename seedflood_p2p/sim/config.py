"""Settings of one simulated run (`SimConfig`), checked when built."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError

METHODS = ("seedflood", "seedflood-naive", "dzsgd", "dsgd", "centralized")
TOPOLOGIES = ("ring", "torus", "random-regular", "complete", "file")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. `run` holds the model, data and estimator settings."""

    method: str = "seedflood"
    peers: int = 16
    rounds: int = 40
    topology: str = field(default="ring", metadata={"choices": TOPOLOGIES})
    degree: int = field(default=4, metadata={"help": "random-regular degree"})
    edges_file: str = field(  # topology "file": one "i j" pair per line (0-based)
        default="", metadata={"flag": "--edges", "help": "edge list file ('i j' lines)"}
    )
    delay: int = field(default=1, metadata={"help": "rounds per hop"})
    loss: float = field(default=0.0, metadata={"help": "per-link loss rate"})
    partition: str = field(  # non-IID by label with dirichlet
        default="iid", metadata={"choices": ("iid", "dirichlet")}
    )
    alpha: float = field(  # smaller: more skewed shards
        default=0.5, metadata={"help": "Dirichlet concentration"}
    )
    eval_every: int = 10
    eval_examples: int = 200
    eval_peers: int = 4  # peers whose own model is evaluated (evenly spaced)
    fo_lr: float = field(default=0.03, metadata={"help": "DSGD learning rate"})
    dzsgd_direction: str = field(default="subcge", metadata={"choices": ("subcge", "gaussian")})
    seed: int = 0  # topology, shards and link losses
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        problems = []
        if self.method not in METHODS:
            problems.append(f"method must be one of {', '.join(METHODS)} (got {self.method!r})")
        if self.topology not in TOPOLOGIES:
            problems.append(f"topology must be one of {', '.join(TOPOLOGIES)}")
        if self.topology == "file" and not self.edges_file:
            problems.append("topology 'file' needs an edges file (--edges)")
        if self.peers < 1 or self.rounds < 0:
            problems.append("peers must be >= 1 and rounds >= 0")
        if self.delay < 0:
            problems.append(f"delay must be >= 0 rounds (got {self.delay})")
        if not 0.0 <= self.loss < 1.0:
            problems.append(f"loss must be in [0, 1) (got {self.loss})")
        if self.partition not in ("iid", "dirichlet"):
            problems.append(f"partition must be 'iid' or 'dirichlet' (got {self.partition!r})")
        if not self.alpha > 0:
            problems.append(f"alpha must be > 0 (got {self.alpha})")
        if self.dzsgd_direction not in ("subcge", "gaussian"):
            problems.append("dzsgd_direction must be 'subcge' or 'gaussian'")
        if self.eval_every < 0 or self.eval_examples < 1 or self.eval_peers < 1:
            problems.append("eval_every must be >= 0, eval_examples and eval_peers >= 1")
        if problems:
            raise UserError("invalid simulation settings: " + "; ".join(problems))

    def replace(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        body = dataclasses.asdict(self)
        body["run"] = json.loads(self.run.to_json())
        return body
