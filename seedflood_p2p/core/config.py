"""Run settings: one frozen dataclass, hashed into the run id.

Every peer of a run must use identical settings, so the settings are the run's
manifest: `run_id` is the SHA-256 of their canonical JSON. Anything that changes
what a message means (rank, refresh period, learning rate, ...) lives here.

A manifest is parsed once (`from_json`; `from_network` for one read from the network)
and the `RunConfig` is passed on. Every number has documented bounds (beside its field,
`INT_RANGES`, core/extra_settings.py); a value outside them is one UserError line that
names the setting. The typed `extra` sections, the manifest JSON and the run id are
computed once per `RunConfig`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from seedflood_p2p.core.checks import is_finite, is_int, peer_ids_problem, short_repr
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.extra_settings import (
    AuditSettings,
    IdentityWork,
    JoinSettings,
    ProbationSettings,
    checkpoint_period,
    extra_with_founders,
)

MANIFEST_VERSION = 2
EPS_RANGE = (1e-6, 1.0)  # perturbation scales whose loss difference estimates a derivative
LR_MAX = 10.0  # lr is 0..LR_MAX: a step of one update; useful ones are below 1
MAX_DIRECTIONS = 16  # scalars per message: 2 bytes each keeps the payload under 64 bytes
FLOAT16_MAX = 65504.0  # scalars travel as float16
# How a message's k scalars become step sizes (RunConfig.normalize): "none" as sent (up to
# `clip`); "rms" divided by their root mean square by the sender; "unit" by every receiver,
# so a message's step has the same size whoever sent it (with k = 1: the sign).
NORMALIZE_CHOICES = ("none", "rms", "unit")
BASIS_CHOICES = ("random", "activation", "kfac")
CALIBRATION_CHOICES = ("", "content-free")
# "per_update": a fixed step per update; the others scale it by the round's size in the
# ledger (subcge.step_divisor).
STEP_RULES = ("per_update", "round_mean", "round_sqrt")
MAX_ROUND = (1 << 62) - 1  # rounds are SQLite integers; the protocol checks against this
MAX_MANIFEST_BYTES = 1 << 16  # a default manifest is ~600 bytes; it travels in one reply
MAX_EXTRA_DEPTH = 8  # nesting of containers in `extra`
MAX_LABELS = 1000  # label words of a classification task
MAX_TASK_TEXT = 4096  # characters of a template, a label word or a label name
TASK_KINDS = ("", "classification", "lm", "completion")
# Settings added after manifest version 2 was fixed, left out of the manifest JSON while
# at their default: manifests written before they existed keep their run id.
OMITTED_WHEN_DEFAULT: dict[str, Any] = {
    "allow_peers": [],
    "task": "",
    "kind": "",
    "template": "",
    "label_words": [],
    "label_names": [],
    "dataset_sha256": "",
    "basis": "random",
    "basis_refresh": 0,
    "basis_examples": 64,
    "basis_damping": 1e-3,
    "basis_output_damping": 0.1,
    "basis_fisher_power": 0.0,
    "basis_sha256": "",
    "step_rule": "per_update",
    "calibration": "",
    "train_examples": 0,
    "momentum": 0.0,
    "one_sided_passes": 0,
    "curvature": 0.0,
}
MOMENTUM_MAX = 0.99  # a round's update is carried on at most 1 / (1 - 0.99) = 100 times
MAX_ALLOW_PEERS = 1000  # peer ids in a closed run's allow-list (~53 bytes each in JSON)
# Model and dataset names that name a file of the organiser's machine: a path, or a data or
# weights file name (workload/tasks.py is_local_path adds "exists here").
PATH_PREFIXES = ("/", ".", "~", "\\")
LOCAL_SUFFIXES = (".jsonl", ".csv", ".json", ".txt", ".tsv", ".gguf", ".safetensors")
# Integer settings and their bounds. The upper bounds are far past any useful value; they
# stop a manifest's 10**30 from reaching code that allocates or converts to C integers.
INT_RANGES = {
    "max_length": (2, 1 << 20),
    "batch_size": (1, 1 << 16),
    "rank": (1, 4096),  # an r x r float64 core per matrix: 128 MiB each at 4096
    "refresh_period": (1, MAX_ROUND),
    "directions": (1, MAX_DIRECTIONS),
    "total_rounds": (0, MAX_ROUND),
    "n_ref": (1, 1 << 20),
    "basis_refresh": (0, MAX_ROUND),
    "basis_examples": (1, 1 << 16),
    "train_examples": (0, 1 << 40),
    "one_sided_passes": (0, MAX_DIRECTIONS),
}


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny-llama"
    dataset: str = "synthetic-sentiment"
    text_column: str = "text"
    label_column: str = "label"
    max_length: int = 64
    batch_size: int = 16
    # The task (workload/tasks.py; docs/TASKS.md). Each is left out of the manifest JSON
    # while it has its default, so runs that do not set it keep their run id.
    task: str = ""  # a preset ("sentiment", "nli", ...); "": the dataset's own shape
    kind: str = ""  # classification | lm | completion; "": the preset's, or from the data
    template: str = ""  # prompt with named fields, e.g. "{premise}\nQuestion: {hypothesis}?"
    # one per label, in label order ("--label-words ' terrible' ' great'")
    label_words: list[str] = field(
        default_factory=list, metadata={"nargs": "+", "help": "one per label, in label order"}
    )
    # the labels as the data file spells them, in label order: "negative" is label 0 ...
    label_names: list[str] = field(
        default_factory=list,
        metadata={"nargs": "+", "help": "string labels of the data, in label order"},
    )
    dataset_sha256: str = ""  # SHA-256 of the parsed examples (filled in by the bootstrap)
    # Train on the first N training examples only (0: all). A smaller set recurs sooner,
    # so a peer's frozen-prefix cache (train_only runs) serves more of each batch.
    train_examples: int = field(
        default=0, metadata={"help": "train on the first N training examples (0: all)"}
    )
    # SubCGE
    rank: int = 8  # r: subspace rank per weight matrix
    refresh_period: int = 20  # T: rounds per epoch (basis refresh)
    eps: float = 1e-3  # perturbation scale of the two-point estimate; in EPS_RANGE
    directions: int = 1  # k: directions (scalars) per message; the batch splits into k groups
    train_norms: bool = False  # also train the scale vectors of normalisation layers
    train_only: str = ""  # comma-separated globs of parameter names; "" trains all candidates
    # unit: every receiver scales a message's k scalars to RMS 1, so no identity's update
    # moves the model further than an honest one's | rms: the sender does | none: as sent
    normalize: str = "unit"
    # with "unit", the step of one update (SmolLM2, whole model, k = 1); 0..LR_MAX
    lr: float = 4e-3
    lr_schedule: str = "constant"  # constant | cosine (needs total_rounds)
    total_rounds: int = 0  # 0: open-ended run
    clip: float = 100.0  # |projected gradient| is clipped to this; in (0, FLOAT16_MAX]
    n_ref: int = 1  # expected peers per round: each message is scaled by lr / n_ref
    include_embeddings: bool = False
    estimator: str = "subcge"  # subcge | naive (full-size Gaussian, for comparison)
    salt: str = "seedflood"  # distinguishes runs with otherwise equal settings
    base_sha256: str = ""  # SHA-256 of the base weights (filled in by the bootstrap)
    # Settings added after manifest version 2, as the manifest spells them (plain JSON, at
    # most MAX_EXTRA_DEPTH deep): "audit", "probation", "checkpoint_every", "join",
    # "identity_work". Parsed once, when the settings are built, into `audit`, `probation`,
    # `checkpoint_every`, `join` and `identity_work` (core/extra_settings.py, with their
    # bounds); read those, not this.
    extra: dict[str, Any] = field(default_factory=dict)
    # A closed run: the base58 peer ids (Ed25519) allowed to take part; updates and repair
    # requests of any other peer are dropped and counted (`not_allowed`). Empty: an open
    # run. Left out of the manifest JSON when empty, so manifests written before it keep
    # their run id (MANIFEST_VERSION stays 2).
    allow_peers: list[str] = field(default_factory=list)
    # Curvature-aware directions (algorithm/basis.py): "random" +-1 bases, or "activation":
    # each linear matrix's V side from the top eigenvectors of its input covariance, whitened,
    # shipped as an artifact computed every `basis_refresh` epochs (0: once, at the base) on
    # the first `basis_examples` training prompts, damping `basis_damping` x mean eigenvalue;
    # or "kfac": the same, and the U side from its output-gradient covariance (K-FAC's G),
    # damped by `basis_output_damping` x the mean of its top-r eigenvalues. With kfac,
    # `basis_fisher_power` p scales each matrix's directions by (its Fisher / the typical
    # matrix's)^p (algorithm/basis.py fisher_gains); 0: all as long as a +-1 direction.
    basis: str = "random"
    basis_refresh: int = 0
    basis_examples: int = 64
    basis_damping: float = 1e-3  # in (0, 1e6)
    basis_output_damping: float = 0.1  # in (0, 1e6)
    basis_fisher_power: float = 0.0  # in [-1, 1]
    # A network run's one activation basis: the SHA-256 of the artifact the run's organiser
    # (its bootstrap node) computed at the base weights; peers fetch it by this digest.
    basis_sha256: str = ""  # (filled in by the bootstrap)
    # How a round's updates share a step: "per_update" each moves lr / n_ref (as always);
    # "round_mean" each moves lr / max(n_t, n_ref), n_t the updates the ledger holds for the
    # round, so a full round is about one step however many peers it carries; "round_sqrt"
    # each moves lr / sqrt(n_t * n_ref) below n_ref and lr / n_t from it: a round of n_t
    # moves sqrt(n_t / n_ref) of a full round's step (docs/LEARNING.md, "The round step").
    step_rule: str = field(
        default="per_update",
        metadata={"choices": STEP_RULES, "help": "how a round's updates share a step"},
    )
    # "content-free": a classification's label logits are read relative to those of the
    # template filled with "N/A", scored under the same direction (contextual calibration):
    # the label prior, the loss's sharpest direction, leaves the estimates (docs/LEARNING.md).
    # One more row per direction in each forward pass. "": the logits as they are.
    calibration: str = field(
        default="",
        metadata={"help": "content-free: label logits relative to the prompt filled with N/A"},
    )
    # Heavy-ball momentum in the fixed basis's core coordinates (algorithm/momentum.py): the
    # state of round T is base - U (sum over rows of w(T - s) c) V^T, w(d) = 1 + b + ... +
    # b^(d-1), so the model stays a linear function of the ledger and the round. 0: none.
    # Needs a basis that never changes (basis "kfac", basis_refresh 0); `seedflood train`
    # and the benches only, for now (daemon_problem).
    momentum: float = field(
        default=0.0,
        metadata={"help": f"heavy-ball momentum in the core coordinates, 0..{MOMENTUM_MAX}"},
    )
    # One-sided estimates sharing one unperturbed pass (FZOO's arithmetic, issue 47 (b)):
    # m > 0 perturbed passes (+eps) after one unperturbed pass; the k directions split into
    # m sets of k/m, the batch into k/m groups, and direction (p, j) is estimated on group j
    # in pass p. So 1 + m passes give k estimates on batch_size * m / k examples each, where
    # the two-point step (0) needs 2 passes for k estimates on batch_size / k each.
    one_sided_passes: int = field(
        default=0,
        metadata={"help": "m perturbed passes sharing one unperturbed pass (0: two-point)"},
    )
    # A diagonal curvature in the fixed basis's core coordinates, learned from the rows
    # themselves (HiSo's idea, issue 47 (c); algorithm/curvature.py): v = b v + (1 - b) D^2
    # over each round's core update D, and every coordinate's perturbation and step scaled
    # by v^(-1/4) (normalised per matrix), so a step moves v^(-1/2) x its derivative. Not
    # linear in the ledger (a late row changes every later round's scale): `seedflood
    # train` and the benches only (daemon_problem). 0: none.
    curvature: float = field(
        default=0.0,
        metadata={"help": f"decay of the diagonal curvature estimate, 0..{MOMENTUM_MAX}"},
    )

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:  # the range checks below assume the types
            raise UserError("invalid run settings: " + "; ".join(problems))
        for name, (low, high) in INT_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high:
                problems.append(f"{name} must be {low}..{high} (got {short_repr(value)})")
        if not (is_finite(self.eps) and EPS_RANGE[0] <= self.eps <= EPS_RANGE[1]):
            problems.append(
                f"eps must be a positive finite number in [{EPS_RANGE[0]:g}, {EPS_RANGE[1]:g}] "
                f"(got {short_repr(self.eps)}): smaller, the two losses differ by float32 "
                "rounding only; larger, the difference is no longer a derivative"
            )
        if not (is_finite(self.lr) and 0 <= self.lr <= LR_MAX):
            problems.append(
                f"lr must be a non-negative finite number at most {LR_MAX:g} "
                f"(got {short_repr(self.lr)})"
            )
        if self.lr_schedule not in ("constant", "cosine"):
            problems.append(
                f"lr_schedule must be 'constant' or 'cosine' (got {short_repr(self.lr_schedule)})"
            )
        if self.lr_schedule == "cosine" and self.total_rounds < 1:
            problems.append("lr_schedule 'cosine' needs total_rounds >= 1")
        if not 0 < self.clip <= FLOAT16_MAX:
            problems.append(f"clip must be in (0, {FLOAT16_MAX:g}] (got {short_repr(self.clip)})")
        passes = self.one_sided_passes
        if 1 <= passes <= MAX_DIRECTIONS and 1 <= self.directions <= MAX_DIRECTIONS:
            if self.directions % passes:
                problems.append(
                    f"one_sided_passes {passes} must divide directions {self.directions} "
                    "(each perturbed pass estimates an equal share of the directions)"
                )
            elif self.batch_size % (self.directions // passes):
                problems.append(
                    f"batch_size {self.batch_size} must be a multiple of directions / "
                    f"one_sided_passes = {self.directions // passes} (the groups of a pass)"
                )
            if self.calibration:
                problems.append(
                    "one_sided_passes with calibration is not built: set calibration ''"
                )
            if self.estimator != "subcge":
                problems.append("one_sided_passes needs the subcge estimator")
        elif 1 <= self.directions <= MAX_DIRECTIONS and self.batch_size % self.directions:
            problems.append(
                f"batch_size {self.batch_size} must be a multiple of directions "
                f"{self.directions} (each direction gets an equal share of the batch)"
            )
        if self.normalize not in NORMALIZE_CHOICES:
            problems.append(
                f"normalize must be one of {', '.join(NORMALIZE_CHOICES)} "
                f"(got {short_repr(self.normalize)})"
            )
        if self.estimator == "naive" and self.directions != 1:
            problems.append("the naive estimator supports directions = 1 only")
        if self.estimator not in ("subcge", "naive"):
            problems.append(
                f"estimator must be 'subcge' or 'naive' (got {short_repr(self.estimator)})"
            )
        if self.basis not in BASIS_CHOICES:
            problems.append(
                f"basis must be one of {', '.join(BASIS_CHOICES)} (got {short_repr(self.basis)})"
            )
        if self.data_basis and self.estimator != "subcge":
            problems.append(f"basis '{self.basis}' needs the subcge estimator")
        if not (0 < self.basis_damping < 1e6 and is_finite(self.basis_damping)):
            problems.append(
                f"basis_damping must be in (0, 1e6) (got {short_repr(self.basis_damping)})"
            )
        if not (0 < self.basis_output_damping < 1e6 and is_finite(self.basis_output_damping)):
            problems.append(
                "basis_output_damping must be in (0, 1e6) "
                f"(got {short_repr(self.basis_output_damping)})"
            )
        if not (-1.0 <= self.basis_fisher_power <= 1.0 and is_finite(self.basis_fisher_power)):
            problems.append(
                f"basis_fisher_power must be in [-1, 1] (got {short_repr(self.basis_fisher_power)})"
            )
        elif self.basis_fisher_power and self.basis != "kfac":
            problems.append("basis_fisher_power needs basis 'kfac' (it scales by K-FAC's Fisher)")
        if self.step_rule not in STEP_RULES:
            problems.append(
                f"step_rule must be one of {', '.join(STEP_RULES)} "
                f"(got {short_repr(self.step_rule)})"
            )
        elif self.round_sized and self.estimator != "subcge":
            problems.append(f"step_rule '{self.step_rule}' needs the subcge estimator")
        if not (is_finite(self.momentum) and 0 <= self.momentum <= MOMENTUM_MAX):
            problems.append(
                f"momentum must be a number in [0, {MOMENTUM_MAX:g}] "
                f"(got {short_repr(self.momentum)})"
            )
        elif self.momentum and not self.fixed_basis:
            problems.append(
                "momentum needs a basis that never changes: basis 'kfac' with basis_refresh 0 "
                "(a round's core coordinates mean the same directions in every later round)"
            )
        if not (is_finite(self.curvature) and 0 <= self.curvature <= MOMENTUM_MAX):
            problems.append(
                f"curvature must be a number in [0, {MOMENTUM_MAX:g}] "
                f"(got {short_repr(self.curvature)})"
            )
        elif self.curvature and not self.fixed_basis:
            problems.append(
                "curvature needs a basis that never changes: basis 'kfac' with basis_refresh 0 "
                "(its estimate lives in the core coordinates of one basis)"
            )
        elif self.curvature and self.momentum:
            problems.append("curvature with momentum is not built: set one of them to 0")
        if self.calibration not in CALIBRATION_CHOICES:
            problems.append(
                f"calibration must be 'content-free' or empty (got {short_repr(self.calibration)})"
            )
        elif self.calibration and self.kind in ("lm", "completion"):
            problems.append(f"calibration needs a classification task (kind is '{self.kind}')")
        if self.base_sha256 and not _is_sha256(self.base_sha256):
            problems.append("base_sha256 must be empty or 64 lowercase hex digits")
        if self.dataset_sha256 and not _is_sha256(self.dataset_sha256):
            problems.append("dataset_sha256 must be empty or 64 lowercase hex digits")
        if self.basis_sha256 and not _is_sha256(self.basis_sha256):
            problems.append("basis_sha256 must be empty or 64 lowercase hex digits")
        if self.basis_sha256 and not self.data_basis:
            problems.append(
                "basis_sha256 names a basis artifact: it needs basis 'activation' or 'kfac'"
            )
        if self.kind not in TASK_KINDS:
            problems.append(
                f"kind must be one of {', '.join(k or repr(k) for k in TASK_KINDS)} "
                f"(got {short_repr(self.kind)})"
            )
        if problem := _task_problem(self):
            problems.append(problem)
        if problem := _extra_problem(self.extra):
            problems.append(problem)
        if problem := peer_ids_problem("allow_peers", self.allow_peers, MAX_ALLOW_PEERS):
            problems.append(problem)
        if problems:
            raise UserError("invalid run settings: " + "; ".join(problems))
        # Frozen: own copies of the containers, so a caller's later change to a dict or
        # list it passed changes neither these settings nor their cached run id.
        for name in ("extra", "allow_peers", "label_words", "label_names"):
            object.__setattr__(self, name, copy.deepcopy(getattr(self, name)))
        # Parse the `extra` sections once, now: a bad one refuses the settings with its own
        # line ("run setting extra.audit: ..."), and readers get typed values.
        for name in ("audit", "probation", "checkpoint_every", "join"):
            getattr(self, name)
        IdentityWork.of(self.extra)  # checked now; `identity_work` needs the run id

    @cached_property
    def audit(self) -> AuditSettings:
        """The run's audit rules (`extra.audit`; audits on unless the run turns them off)."""
        return AuditSettings.of(self.extra)

    @cached_property
    def probation(self) -> ProbationSettings:
        """The run's probation rules (`extra.probation`; the allow-list's peers are founders)."""
        return ProbationSettings.of(self.extra, self.allowed_peer_ids())

    @cached_property
    def checkpoint_every(self) -> int:
        """Rounds per link of the run's checkpoint chain (`extra.checkpoint_every`; 0: none)."""
        return checkpoint_period(self.extra)

    @cached_property
    def join(self) -> JoinSettings:
        """How peers join the run (`extra.join`: open, or ticketed by its creator)."""
        return JoinSettings.of(self.extra)

    @cached_property
    def identity_work(self) -> IdentityWork:
        """The work an identity must carry to take part (`extra.identity_work`; off unless
        set), bound to this run's id; the identities the manifest names are exempt."""
        work = IdentityWork.of(self.extra)
        if not work.enabled:
            return work
        exempt = set(self.probation.founders) | set(self.allowed_peer_ids() or ())
        if self.join.creator is not None:
            exempt.add(self.join.creator)
        return dataclasses.replace(work, run_key=self.run_key, exempt=frozenset(exempt))

    def lr_at(self, round_: int) -> float:
        """Learning rate of round `round_`: a pure function, identical on all peers."""
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(round_, self.total_rounds) / self.total_rounds
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))

    def epoch_of(self, round_: int) -> int:
        return round_ // self.refresh_period

    @property
    def round_sized(self) -> bool:
        """Whether an update's step depends on how many updates its round holds (then a
        late row re-scales its round: algorithm/live.py)."""
        return self.step_rule in ("round_mean", "round_sqrt")

    def to_json(self) -> str:
        """The manifest: canonical JSON, what the run id hashes (built once)."""
        return self._manifest_json

    @cached_property
    def _manifest_json(self) -> str:
        body = {"manifest_version": MANIFEST_VERSION, **dataclasses.asdict(self)}
        for name, default in OMITTED_WHEN_DEFAULT.items():  # as manifests always were
            if body[name] == default and type(body[name]) is type(default):
                del body[name]
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @cached_property
    def run_id(self) -> str:
        """SHA-256 of the manifest, hex; computed once (audits read it for every update)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @cached_property
    def run_key(self) -> bytes:
        return bytes.fromhex(self.run_id)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        """The settings of a manifest; anything but a manifest this version wrote is one
        UserError line (never a traceback): it may come from a stranger's bootstrap node."""
        if not isinstance(text, (str, bytes)):
            raise UserError(f"run manifest is {type(text).__name__}, not JSON text: it is corrupt")
        if len(text) > MAX_MANIFEST_BYTES:
            raise UserError(
                f"run manifest is {len(text)} bytes, over {MAX_MANIFEST_BYTES}: it was not "
                "written by seedflood"
            )
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, int of > 4300 digits
            if isinstance(exc, RecursionError):
                reason = "nested too deeply"
            elif isinstance(exc, json.JSONDecodeError):
                reason = str(exc)
            else:
                reason = "a number too long to convert"
            raise UserError(f"run manifest is not valid JSON ({reason})") from None
        if not isinstance(body, dict):
            raise UserError("run manifest is not a JSON object: it was not written by seedflood")
        version = body.pop("manifest_version", None)
        if not is_int(version):  # `true` must not pass as version 1, nor 2.0 as 2
            raise UserError(
                f"run manifest has no integer manifest_version (got {short_repr(version)}): "
                "it is corrupt or was not written by seedflood"
            )
        if version != MANIFEST_VERSION:
            raise UserError(
                f"run manifest version {short_repr(version)} is not supported by this seedflood "
                f"(expects {MANIFEST_VERSION}): upgrade seedflood-p2p to the run's version"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(body) - names)
        if unknown:
            shown = short_repr(unknown)
            raise UserError(f"run manifest has unknown settings {shown}: upgrade seedflood-p2p")
        for f in dataclasses.fields(cls):
            if f.name in body and not _has_type(body[f.name], f.type):
                raise UserError(
                    f"run manifest setting '{f.name}' must be {f.type}, got "
                    f"{short_repr(body[f.name])}: the manifest is corrupt or from another program"
                )
        # A manifest written before `normalize` existed applied scalars as sent: its run
        # must not change meaning now that "unit" is the default.
        body.setdefault("normalize", "none")
        return cls(**body)

    @classmethod
    def from_network(cls, text: str | bytes) -> RunConfig:
        """The settings of a manifest read from the network (a bootstrap node's reply, a DHT
        record): `from_json`, and none of its names may point into this machine. A model or
        dataset named by a path is the organiser's file: a peer fetches its copy by the
        manifest's digest and never opens the path (workload/tasks.py run_sources), so the
        path must come with that digest and may not climb (`..`) or start at a home (`~`)."""
        config = cls.from_json(text)
        for name, digest_name in (("model", "base_sha256"), ("dataset", "dataset_sha256")):
            if problem := _network_path_problem(name, getattr(config, name), digest_name, config):
                raise UserError(f"run manifest from the network refused: {problem}")
        return config

    def daemon_problem(self) -> str | None:
        """Why the peer daemon and bootstrap node cannot run these settings yet (None: they
        can). A network run carries one basis artifact, the organiser's, computed at the
        base weights; a basis refreshed as training moves needs a publisher the network
        does not have yet (`seedflood train` computes and replays refreshed ones)."""
        if self.data_basis and self.basis_refresh:
            return (
                f"basis_refresh {self.basis_refresh} runs in `seedflood train` only: a network "
                "run carries one basis artifact, computed by its bootstrap node at the base "
                "weights; set basis_refresh = 0"
            )
        if self.curvature:
            return (
                f"curvature {self.curvature:g} runs in `seedflood train` and the benches only: "
                "its state is not linear in the ledger (a late row changes the scale of "
                "every later round); set curvature = 0"
            )
        if self.momentum and self.checkpoint_every and not self.audit.enabled:
            return (
                "momentum with a checkpoint chain (extra.checkpoint_every) is not built: "
                "the chain's links do not carry the velocity; set one of them to 0"
            )
        return None

    @property
    def fixed_basis(self) -> bool:
        """Whether every round's directions live in one basis: K-FAC's U and V sides, computed
        once at the base weights (what momentum across rounds needs)."""
        return self.basis == "kfac" and self.basis_refresh == 0

    @property
    def data_basis(self) -> bool:
        """Whether the run's directions come from a basis artifact (not Philox alone)."""
        return self.basis in ("activation", "kfac")

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def with_founders(self, founders: list[str]) -> RunConfig:
        """These settings with `founders` (base58 peer ids) as the run's probation founders
        (`extra.probation.founders`; its other keys kept as written). A bad id, or founders
        (or probation = false) already set, is one UserError line."""
        return self.replace(extra=extra_with_founders(self.extra, founders))

    def allowed_peer_ids(self) -> frozenset[bytes] | None:
        """The allow-list as raw peer ids; None for an open run."""
        if not self.allow_peers:
            return None
        import base58

        return frozenset(base58.b58decode(p) for p in self.allow_peers)


_KINDS = {"int": int, "float": (int, float), "str": str, "bool": bool, "list[str]": list}


def _has_type(value: object, annotation: str) -> bool:
    """`value` fits a RunConfig field annotated `annotation` (bool is no int or float)."""
    kind = _KINDS.get(annotation, dict)
    if annotation == "list[str]":
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    return isinstance(value, bool) is (annotation == "bool") and isinstance(value, kind)


def names_a_path(name: str) -> bool:
    """Whether a model or dataset name is written as a path or a file name (not a built-in
    name or a hub id such as "HuggingFaceTB/SmolLM2-135M")."""
    return name.startswith(PATH_PREFIXES) or name.lower().endswith(LOCAL_SUFFIXES)


def _network_path_problem(name: str, value: str, digest_name: str, config: RunConfig) -> str | None:
    """Why setting `name` (= `value`) may not come from the network; None if it may."""
    if not names_a_path(value):
        return None
    parts = value.replace("\\", "/").split("/")
    if ".." in parts or value.startswith("~") or any(ord(c) < 32 for c in value):
        return (
            f"{name} {short_repr(value)} is a path that climbs (..), starts at a home (~) or "
            "holds control characters"
        )
    if not getattr(config, digest_name):
        return (
            f"{name} {short_repr(value)} is a path on the organiser's machine and the manifest "
            f"has no {digest_name} to fetch and check a copy by"
        )
    return None


def _task_problem(config: RunConfig) -> str | None:
    """Sizes of the task settings (their meaning is checked where the task is loaded)."""
    for name in ("label_words", "label_names"):
        values = getattr(config, name)
        if len(values) > MAX_LABELS:
            return f"{name} lists {len(values)} values, more than {MAX_LABELS}"
        if len(set(values)) != len(values):
            return f"{name} lists a value twice ({short_repr(values)})"
        if any(not v or len(v) > MAX_TASK_TEXT for v in values):
            return f"{name} values must be 1..{MAX_TASK_TEXT} characters"
    if len(config.template) > MAX_TASK_TEXT or len(config.task) > 100:
        return f"template must be at most {MAX_TASK_TEXT} characters, task at most 100"
    if config.label_words and config.label_names:
        if len(config.label_words) != len(config.label_names):
            return (
                f"label_words has {len(config.label_words)} values and label_names "
                f"{len(config.label_names)}: give one of each per label, in label order"
            )
    return None


def _type_problems(config: RunConfig) -> list[str]:
    return [
        f"{f.name} must be {f.type} (got {short_repr(getattr(config, f.name))})"
        for f in dataclasses.fields(config)
        if not _has_type(getattr(config, f.name), f.type)
    ]


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _extra_problem(extra: dict) -> str | None:
    """`extra` must be plain JSON (str keys, finite numbers, 64-bit integers), nested at most
    MAX_EXTRA_DEPTH deep, so the manifest encodes, hashes and decodes the same everywhere."""
    stack: list[tuple[object, int]] = [(extra, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_EXTRA_DEPTH:
                return f"extra is nested deeper than {MAX_EXTRA_DEPTH} levels"
            if isinstance(value, dict):
                if not all(isinstance(k, str) for k in value):
                    return "extra must have string keys only"
                items = value.values()
            else:
                items = value
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, float) and not math.isfinite(value):
            return f"extra holds a non-finite number ({value})"
        elif is_int(value) and not -(1 << 63) <= value < 1 << 63:
            return "extra holds an integer beyond 64 bits"
        elif not (value is None or isinstance(value, (bool, int, float, str))):
            return f"extra holds a {type(value).__name__}, not a JSON value"
    return None
