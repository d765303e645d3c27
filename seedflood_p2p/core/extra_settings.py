"""The typed settings a run's manifest keeps in its `extra` table.

Settings added after manifest version 2 was fixed live under `extra`, so a run that does
not set them keeps its run id: `extra.audit` (`AuditSettings`), `extra.probation`
(`ProbationSettings`), `extra.checkpoint_every` (the chain period), `extra.join`
(`JoinSettings`) and `extra.identity_work` (`IdentityWork`). `RunConfig` parses each once,
when it is built, into the typed attributes `audit`, `probation`, `checkpoint_every`,
`join` and `identity_work`; code reads those, never `extra`. Each parser turns a bad value
into one UserError line naming the setting.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from seedflood_p2p.core.checks import is_finite, is_int, is_number, peer_ids_problem, short_repr
from seedflood_p2p.core.errors import UserError

# ------------------------------------------------------------------------------- audits


@dataclass(frozen=True)
class AuditRule:
    """When does a recomputed update contradict the claim?

    Per scalar, |claimed - recomputed| > max(absolute, relative * max(|claimed|,
    |recomputed|), spread * rms(recomputed)). `relative` bounds the honest disagreement of
    two live models that differ by a few rounds of merged updates; `absolute` keeps scalars
    near zero (where a relative error means nothing) from accusing anyone; `spread` does
    the same at the update's own scale: two honest CPUs (other kernels, other thread
    counts) differ by float32 noise in (L+ - L-) / 2 eps that does not shrink with a
    scalar, up to 0.0045 x the update's RMS for SmolLM2 at 16 scalars
    (bench/results/audit-hardware.md). The RMS is the auditor's recomputation's, so a
    claim cannot widen its own bound. Defaults: from the measured honest mismatch,
    bench/results/audit_mismatch.md.
    """

    relative: float = 0.5
    absolute: float = 0.05
    spread: float = 0.0

    def mismatches(self, claimed: Iterable[float], recomputed: Iterable[float]) -> bool:
        # memoized: a judgement asks the same (claim, record) pair once per settled
        # prefix (`probation.ban_spans`), and each new record brings a new judgement
        return _mismatches(self, tuple(claimed), tuple(recomputed))

    def bounds(self, c: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Each scalar's tolerance (float64 arrays of one shape: claimed, recomputed)."""
        bound = np.maximum(self.absolute, self.relative * np.maximum(np.abs(c), np.abs(r)))
        if self.spread and r.size:
            bound = np.maximum(bound, self.spread * float(np.sqrt(np.mean(r * r))))
        return bound


@functools.lru_cache(maxsize=8192)
def _mismatches(rule: AuditRule, claimed: tuple, recomputed: tuple) -> bool:
    c = np.asarray(claimed, dtype=np.float64)
    r = np.asarray(recomputed, dtype=np.float64)
    if c.shape != r.shape:
        return True
    return bool(np.any(np.abs(c - r) > rule.bounds(c, r)))


# Bounds of `extra.audit`'s numbers (inclusive). cpu_share is a share of one peer's training
# CPU spent on audits; above 1 a peer audits more than it trains (tests and benches audit
# every update that way). relative and absolute are tolerances of `AuditRule`.
AUDIT_INT_RANGES = {"lag": (0, 1000), "quorum": (1, 1000)}
AUDIT_FLOAT_RANGES = {
    "cpu_share": (0.0, 1000.0),
    "relative": (0.0, 1e6),
    "absolute": (0.0, 1e6),
    "spread": (0.0, 1e6),
}


@dataclass(frozen=True)
class AuditSettings:
    """A run's audit rules, from its manifest (`extra.audit`). Every peer must judge with
    the same settings.

    lag: the settled state an update is computed on and audited against: round t's update
    is computed on base + every counted update of rounds < t - lag. 0 is lockstep (the
    simulator, `seedflood train`). The measured honest mismatch on a live model one round
    apart is tens of percent of the scalar (bench/results/audit_mismatch-*.md), on the
    same state it is zero, so the audit needs an agreed state.
    """

    enabled: bool = False
    cpu_share: float = 0.10  # of a peer's training CPU spent on audits (the production rate)
    lag: int = 0
    relative: float = 0.01
    absolute: float = 0.002
    # 4.4x the largest honest cross-CPU difference measured (0.0045 x RMS, SmolLM2 at 16
    # scalars); a cheat within it moves each direction by under 2% of the update's RMS
    spread: float = 0.02
    quorum: int = 3  # votes of one kind (and a majority) that decide a case

    @property
    def rule(self) -> AuditRule:
        return AuditRule(relative=self.relative, absolute=self.absolute, spread=self.spread)

    @property
    def delay(self) -> int:
        """Rounds an audit of round t waits: it is done when the auditor trains round
        t + delay at the earliest (peer/audit_duty.py `ready`), so an honest record of round t
        is published at t + delay or later (its `at`)."""
        return self.lag + 3

    @classmethod
    def of(cls, extra: Mapping) -> AuditSettings:
        """From a manifest's `extra`; an unknown key or a bad value is a UserError line.

        Secure by default: a manifest without `extra.audit` has audits at the production
        settings (`DEFAULT_AUDIT`); only `audit = false` (or `enabled = false`) turns them
        off. A ledger without audit records judges the same either way (nothing is voided),
        so an older run without the key replays as before."""
        body = extra.get("audit", DEFAULT_AUDIT)
        if body is None or body is False:
            return cls()
        if body is True:
            return cls(enabled=True)
        if not isinstance(body, Mapping):
            raise UserError("run setting extra.audit must be true, false or a table of settings")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(body) - known)
        if unknown:
            raise UserError(
                f"run setting extra.audit has unknown keys {unknown}: known {sorted(known)}"
            )
        body = {"enabled": True, **body}
        problems = []
        if not isinstance(body["enabled"], bool):
            problems.append("enabled must be true or false")
        for name, (low, high) in AUDIT_INT_RANGES.items():
            value = body.get(name, getattr(cls, name))
            if not (is_int(value) and low <= value <= high):
                problems.append(f"{name} must be an integer {low}..{high}")
        for name, (low, high) in AUDIT_FLOAT_RANGES.items():
            value = body.get(name, getattr(cls, name))
            if not (is_number(value) and is_finite(value) and low <= value <= high):
                problems.append(f"{name} must be a finite number in [{low:g}, {high:g}]")
        if problems:
            raise UserError("run setting extra.audit: " + "; ".join(problems))
        return cls(**body)


# What a run whose manifest does not mention `extra.audit` gets: audits on at 10% of the
# training CPU. lag 3: the daemon's default --max-staleness is 2, so every peer holds the
# updates of rounds < t - 3 when it trains round t.
DEFAULT_AUDIT: Mapping = {"lag": 3, "cpu_share": 0.10, "quorum": 3}

# ---------------------------------------------------------------------------- probation

DEFAULT_VOUCHES = 3  # vouched updates that make an identity established
DEFAULT_SHARE = 0.25  # of an established peer's training CPU spent on probation audits
MAX_FOUNDERS = 1000
MAX_VOUCHES = 1000
MAX_SHARE = 100.0  # `share` is in (0, MAX_SHARE]


@dataclass(frozen=True)
class ProbationSettings:
    """A run's probation rules, from its manifest (`extra.probation`, and `allow_peers`).

    founders: raw peer ids established from the start (the run creator's peers).
    vouches: vouched updates that make an identity established.
    share: of an established peer's training CPU that probation audits may take (the
    verification budget; one audit costs one training step, so `share` audits per round).
    """

    founders: frozenset[bytes] = frozenset()
    vouches: int = DEFAULT_VOUCHES
    share: float = DEFAULT_SHARE
    off: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.founders) and not self.off

    @classmethod
    def of(cls, extra: Mapping, allowed: frozenset[bytes] | None) -> ProbationSettings:
        """From a manifest's `extra.probation` (false, or a table of founders (base58 peer
        ids), vouches, share) and its allow-list `allowed` (allowed peers are founders).
        A bad value is one UserError line."""
        import base58

        body = extra.get("probation", {})
        if body is False:
            return cls(off=True)
        if not isinstance(body, Mapping):
            raise UserError("run setting extra.probation must be false or a table of settings")
        unknown = sorted(set(body) - {"founders", "vouches", "share"})
        if unknown:
            raise UserError(
                f"run setting extra.probation has unknown keys {unknown}: "
                "known ['founders', 'share', 'vouches']"
            )
        founders = body.get("founders", [])
        vouches = body.get("vouches", DEFAULT_VOUCHES)
        share = body.get("share", DEFAULT_SHARE)
        problems = []
        if not (isinstance(founders, list) and all(isinstance(f, str) for f in founders)):
            problems.append("founders must be a list of base58 peer ids")
            founders = []
        elif problem := peer_ids_problem("founders", founders, MAX_FOUNDERS):
            problems.append(problem)
        if not (is_int(vouches) and 1 <= vouches <= MAX_VOUCHES):
            problems.append(f"vouches must be an integer 1..{MAX_VOUCHES}")
        if not (is_number(share) and is_finite(share) and 0 < share <= MAX_SHARE):
            problems.append(f"share must be a number in (0, {MAX_SHARE:g}]")
        if problems:
            raise UserError("run setting extra.probation: " + "; ".join(problems))
        ids = {base58.b58decode(f) for f in founders} | set(allowed or ())
        return cls(frozenset(ids), int(vouches), float(share))


def extra_with_founders(extra: Mapping, founders: list[str]) -> dict:
    """`extra` with `probation.founders` = `founders` (base58 peer ids, as given), for
    `RunConfig.with_founders`. It edits the manifest as it is spelled, every other key of
    `extra.probation` kept as written: `ProbationSettings` forgets which keys were written
    and in what order (and folds in the allow-list), so writing it back would change the
    manifest bytes and the run id. `extra` was checked when its RunConfig was built, so its
    probation is absent, false or a table. Founders set there too is one UserError line."""
    probation = extra.get("probation", {})
    if probation is False or (isinstance(probation, Mapping) and "founders" in probation):
        raise UserError(
            "--founders and the config file's extra.probation both set probation: keep one"
        )
    return {**extra, "probation": {**probation, "founders": list(founders)}}


# --------------------------------------------------------------------- checkpoint chain

MAX_CHECKPOINT_EVERY = 1 << 40  # rounds per link; past any run's length


def checkpoint_period(extra: Mapping) -> int:
    """P of `extra.checkpoint_every`: rounds per link of the run's checkpoint chain (0: the
    run has none). One readable line if malformed."""
    every = extra.get("checkpoint_every", 0)
    if not (is_int(every) and 0 <= every <= MAX_CHECKPOINT_EVERY):
        raise UserError(
            f"run setting extra.checkpoint_every must be a whole number of rounds "
            f"0..{MAX_CHECKPOINT_EVERY}, got {short_repr(every)}"
        )
    return every


# --------------------------------------------------------------------------------- join

JOIN_MODES = ("open", "allow-listed", "ticketed")


@dataclass(frozen=True)
class JoinSettings:
    """How peers join a run that is not allow-listed (`extra.join`): "open", or "ticketed"
    with `creator`, the raw peer id whose key signs the run's join tickets."""

    mode: str = "open"
    creator: bytes | None = None

    @classmethod
    def of(cls, extra: Mapping) -> JoinSettings:
        """From a manifest's `extra.join`; a bad value is one UserError line."""
        import base58

        body = extra.get("join")
        if body is None:
            return cls()
        if not isinstance(body, Mapping) or set(body) - {"mode", "creator"}:
            raise UserError("run setting extra.join must be a table with keys mode and creator")
        mode = body.get("mode", "open")
        if mode not in JOIN_MODES or mode == "allow-listed":
            raise UserError(
                "run setting extra.join.mode must be 'open' or 'ticketed' (an allow-listed run "
                "sets allow_peers)"
            )
        if mode != "ticketed":
            return cls()
        creator = body.get("creator")
        if not isinstance(creator, str) or peer_ids_problem("creator", [creator], 1):
            raise UserError("run setting extra.join.creator must be a base58 Ed25519 peer id")
        return cls(mode, base58.b58decode(creator))


# ------------------------------------------------------------------------ identity work

MAX_WORK_DIFFICULTY = 32  # leading zero bits; ~2^32 key generations is days of CPU


def work_bits(run_key: bytes, peer: bytes) -> int:
    """Leading zero bits of blake2b-256(run_key || peer): the work identity `peer` (raw
    peer id bytes) carries for the run whose id is `run_key` (its 32 bytes). The salt is
    the run id itself: a key ground for one run is worth nothing in another, and it is
    known as soon as the manifest is fixed (identities are made after)."""
    digest = hashlib.blake2b(run_key + peer, digest_size=32).digest()
    return 256 - int.from_bytes(digest, "big").bit_length()


@dataclass(frozen=True)
class IdentityWork:
    """Identities that cost work (`extra.identity_work`, S/Kademlia's static puzzle): an
    identity takes part in the run only if `work_bits(run id, its peer id)` is at least
    `difficulty` (0: off). Each bit doubles the expected key generations a newcomer grinds
    (`seedflood keygen`; bench/results/identity-work.md). The identities the manifest names
    (founders, allow-listed peers, the join ticket creator) are `exempt`: they are in the
    manifest the run id hashes, so no key of theirs could be ground against it, and the
    manifest already vouches for them.

    `RunConfig.identity_work` fills in `run_key` and `exempt`; `of` reads the difficulty."""

    difficulty: int = 0
    run_key: bytes = b""
    exempt: frozenset[bytes] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.difficulty > 0

    def qualifies(self, peer: bytes) -> bool:
        """Does `peer` (raw peer id) carry the run's work (or need none)?"""
        return (
            not self.enabled
            or peer in self.exempt
            or work_bits(self.run_key, peer) >= self.difficulty
        )

    @classmethod
    def of(cls, extra: Mapping) -> IdentityWork:
        """From a manifest's `extra.identity_work` (a table {difficulty}); absent: off. A bad
        value is one UserError line."""
        body = extra.get("identity_work")
        if body is None:
            return cls()
        if not isinstance(body, Mapping) or set(body) - {"difficulty"}:
            raise UserError("run setting extra.identity_work must be a table with key difficulty")
        difficulty = body.get("difficulty", 0)
        if not (is_int(difficulty) and 0 <= difficulty <= MAX_WORK_DIFFICULTY):
            raise UserError(
                "run setting extra.identity_work.difficulty must be an integer "
                f"0..{MAX_WORK_DIFFICULTY} (leading zero bits), got {short_repr(difficulty)}"
            )
        return cls(int(difficulty))
