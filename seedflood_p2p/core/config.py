"""Run settings: one plain dataclass, hashed into the run id.

Every peer of a run must use identical settings, so the settings are the run's
manifest: `run_id` is the SHA-256 of their canonical JSON. Anything that changes
what a message means (rank, refresh period, learning rate, ...) lives here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from seedflood_p2p.core.errors import UserError

MANIFEST_VERSION = 2
MAX_DIRECTIONS = 16  # scalars per message: 2 bytes each keeps the payload under 64 bytes
FLOAT16_MAX = 65504.0  # scalars travel as float16


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny-llama"
    dataset: str = "synthetic-sentiment"
    text_column: str = "text"
    label_column: str = "label"
    max_length: int = 64
    batch_size: int = 16
    # SubCGE
    rank: int = 8  # r: subspace rank per weight matrix
    refresh_period: int = 20  # T: rounds per epoch (basis refresh)
    eps: float = 1e-3  # perturbation scale of the two-point estimate
    directions: int = 1  # k: directions (scalars) per message; the batch splits into k groups
    train_norms: bool = False  # also train the scale vectors of normalisation layers
    train_only: str = ""  # comma-separated globs of parameter names; "" trains all candidates
    normalize: str = "none"  # none | rms: the sender divides its k scalars by their RMS
    lr: float = 1e-4
    lr_schedule: str = "constant"  # constant | cosine (needs total_rounds)
    total_rounds: int = 0  # 0: open-ended run
    clip: float = 100.0  # |projected gradient| is clipped to this
    n_ref: int = 1  # expected peers per round: each message is scaled by lr / n_ref
    include_embeddings: bool = False
    estimator: str = "subcge"  # subcge | naive (full-size Gaussian, for comparison)
    salt: str = "seedflood"  # distinguishes runs with otherwise equal settings
    base_sha256: str = ""  # SHA-256 of the base weights (filled in by the bootstrap)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 1:
            problems.append(f"rank must be >= 1 (got {self.rank})")
        if self.refresh_period < 1:
            problems.append(f"refresh_period must be >= 1 (got {self.refresh_period})")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            problems.append(f"eps must be a positive number (got {self.eps})")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            problems.append(f"lr must be a non-negative number (got {self.lr})")
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append(
                f"lr_schedule must be 'constant' or 'cosine' (got {self.lr_schedule!r})"
            )
        if self.lr_schedule == "cosine" and self.total_rounds < 1:
            problems.append("lr_schedule 'cosine' needs total_rounds >= 1")
        if not 0 < self.clip <= FLOAT16_MAX:
            problems.append(f"clip must be in (0, {FLOAT16_MAX:g}] (got {self.clip})")
        if not 1 <= self.directions <= MAX_DIRECTIONS:
            problems.append(f"directions must be 1..{MAX_DIRECTIONS} (got {self.directions})")
        elif self.batch_size % self.directions:
            problems.append(
                f"batch_size {self.batch_size} must be a multiple of directions "
                f"{self.directions} (each direction gets an equal share of the batch)"
            )
        if self.normalize not in ("none", "rms"):
            problems.append(f"normalize must be 'none' or 'rms' (got {self.normalize!r})")
        if self.estimator == "naive" and self.directions != 1:
            problems.append("the naive estimator supports directions = 1 only")
        if self.n_ref < 1:
            problems.append(f"n_ref must be >= 1 (got {self.n_ref})")
        if self.batch_size < 1 or self.max_length < 2:
            problems.append("batch_size must be >= 1 and max_length >= 2")
        if self.estimator not in ("subcge", "naive"):
            problems.append(f"estimator must be 'subcge' or 'naive' (got {self.estimator!r})")
        if problems:
            raise UserError("invalid run settings: " + "; ".join(problems))

    def lr_at(self, round_: int) -> float:
        """Learning rate of round `round_`: a pure function, identical on all peers."""
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(round_, self.total_rounds) / self.total_rounds
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))

    def epoch_of(self, round_: int) -> int:
        return round_ // self.refresh_period

    def to_json(self) -> str:
        body = {"manifest_version": MANIFEST_VERSION, **dataclasses.asdict(self)}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @property
    def run_key(self) -> bytes:
        return bytes.fromhex(self.run_id)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"run manifest is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise UserError("run manifest is not a JSON object: it was not written by seedflood")
        version = body.pop("manifest_version", None)
        if version != MANIFEST_VERSION:
            raise UserError(
                f"run manifest version {version} is not supported by this seedflood "
                f"(expects {MANIFEST_VERSION}): upgrade seedflood-p2p to the run's version"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(body) - names)
        if unknown:
            raise UserError(f"run manifest has unknown settings {unknown}: upgrade seedflood-p2p")
        kinds = {"int": int, "float": (int, float), "str": str, "bool": bool}
        for f in dataclasses.fields(cls):
            if f.name not in body:
                continue
            value, kind = body[f.name], kinds.get(f.type, dict)
            if isinstance(value, bool) is not (f.type == "bool") or not isinstance(value, kind):
                raise UserError(
                    f"run manifest setting '{f.name}' must be {f.type}, got {value!r}: "
                    "the manifest is corrupt or from another program"
                )
        return cls(**body)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)
