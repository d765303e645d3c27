"""The live model: the weights a participant trains on, kept equal to base + its ledger.

Invariant: model + `pending` = base + ledger. Every accepted update (anyone's, our own
included) is logged first and then handed to `receive`; `apply` folds a batch of them
into the weights (SubCGE: accumulate + commit, O(n + r*d)). Updates are additive, so the
order they arrive and are applied in changes the weights only by float32 rounding; a
replay of the ledger in canonical order (`replay.replay`) is the reference they agree
with. An equivocation taken back arrives as the old update negated followed by the kept
one (the admission pipeline hands both on), which is again just two more additions.

`cut` takes the ledger as it is now together with what is pending. A checkpoint applies
the pending updates and writes the weights beside the cut's digest, the cut's rows
(compact) and the hash of the tensors; `restore` rebuilds the weights as base + cut: from
a checkpoint of exactly this cut, or from a checkpoint of an older cut plus the rows it
does not cover (updates are additive), else by replay. A checkpoint whose tensors do not
hash as recorded, or whose rows differ from the ledger's, is refused (replay instead).

Threads: `receive`, `take` and `cut` run where updates are accepted (the daemon's event
loop), `apply`, `restore` and `checkpoint` where the model lives (its model thread).
Taking the cut where accepts run, with no other work in between, puts every update in
exactly one of the cut and the new pending list: none applied twice, none missed.

Under step_rule "round_mean" an update's step is lr / max(n_t, n_ref), n_t the updates its
round holds ("round_sqrt": lr / sqrt(n_t n_ref) below n_ref), so a row arriving late (or
taken back) changes the step of every row of its round already applied. The live model
keeps the rows it holds per round (`held`) and, when a round's size changes, re-scales
that round's applied rows: each is added again at the new size and taken back at the old
one (two more additions each, O(n_t) for the round).
A replay applies each row once at the ledger's final size; the live weights agree with it
to float32 rounding, as for any late row.

A joiner may trust a checkpoint link a quorum of peers offers without holding the rows it
covers (`restore_trusting`: the peer's `--history-sync background`): the weights are then
base + those rows through the link, `trusted` names them, and `receive` drops them when
repair brings them later (they are in the weights already). `check_history` says when the
ledger holds them all and whether they digest as the link recorded; until then the
invariant reads model + pending = base + trusted rows + the ledger's other rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from seedflood_p2p.algorithm.basis import BasisSchedule
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.subcge import ZerothOrderEstimator, step_divisor
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.checkpoint import (
    read_checkpoint_meta,
    read_checkpoint_weights,
    tensors_sha256,
    write_checkpoint,
)
from seedflood_p2p.storage.cut import CutEncoder, CutRanges, cut_contains
from seedflood_p2p.storage.digests import RunningDigest, digest_of, digest_within, row_digest
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.live")

VELOCITY = "momentum/velocity"  # a checkpoint's momentum velocity (float64), beside the weights


@dataclass(frozen=True)
class LedgerCut:
    """The ledger at one instant, and the accepted updates the model had not applied then."""

    # canonical order: a list (`cut`), or a snapshot read again on each pass (`streamed_cut`)
    messages: Collection[UpdateMessage]
    digest: str | None  # digest_of(messages), what a checkpoint of it is labelled with;
    # None for a start cut (`restore` digests the rows in the pass it makes anyway)
    unapplied: list[UpdateMessage]

    def close(self) -> None:
        """End a start cut's snapshot (a list has nothing to end)."""
        close = getattr(self.messages, "close", None)
        if close is not None:
            close()


class LiveModel:
    def __init__(self, engine: ZerothOrderEstimator, ledger: Ledger | None = None) -> None:
        self.engine = engine
        self.ledger = ledger  # needed by `cut` only
        self.pending: list[UpdateMessage] = []
        # round-sized step rules only: round -> peer -> the scalars applied for it
        self.held: dict[int, dict[bytes, tuple[float, ...]]] = {}
        # the rows of a link trusted before the ledger held them (`restore_trusting`),
        # with the link's meta; None once the history is checked (`check_history`)
        self.trusted: CutRanges | None = None
        self.trusted_meta: dict | None = None
        self.trusted_held = 0  # how many of its rows the ledger held at `restore_trusting`

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def config(self):
        return self.engine.config

    # -- where updates are accepted ------------------------------------------------
    def receive(self, messages: Iterable[UpdateMessage]) -> None:
        """Updates just logged to the ledger; applied at the next `apply(take())`. Rows of
        a trusted link (history arriving after the join) are in the weights already."""
        trusted = self.trusted
        if trusted is None:
            self.pending.extend(messages)
        else:
            self.pending.extend(m for m in messages if (m.peer, m.round) not in trusted)

    def take(self) -> list[UpdateMessage]:
        """Everything received since the last take, to be applied by the caller."""
        incoming, self.pending = self.pending, []
        return incoming

    def take_settled(self, next_round: int, lag: int) -> list[UpdateMessage]:
        """The received updates that belong to the settled model of `next_round` (rounds
        < next_round - lag: the state audits recompute on, `audit.AuditSettings.lag`);
        later rounds stay pending. With lag 0 and lockstep rounds this is `take`."""
        limit = next_round - lag
        settled = [m for m in self.pending if m.round < limit]
        self.pending = [m for m in self.pending if m.round >= limit]
        return settled

    def cut(self) -> LedgerCut:
        """The ledger now, plus the pending updates (which the ledger already holds)."""
        if self.ledger is None:
            raise ValueError("a LiveModel without a ledger has no cut")
        unapplied = self.take()
        messages = list(self.ledger.messages())
        return LedgerCut(messages, digest_of(messages), unapplied)

    def streamed_cut(self) -> LedgerCut:
        """`cut` with the rows as a snapshot of the ledger, read again on each pass
        (`Ledger.snapshot`), so restoring (or checkpointing) 10M rows does not hold 10M
        objects; taken where `cut` is, for the same reason. `cut.close()` when done."""
        if self.ledger is None:
            raise ValueError("a LiveModel without a ledger has no cut")
        unapplied = self.take()
        return LedgerCut(self.ledger.snapshot(), None, unapplied)

    # -- where the model lives --------------------------------------------------------
    def apply(self, messages: list[UpdateMessage]) -> int:
        """Fold `messages` into the weights; the sender's own update goes through here too,
        with the float16 scalars it published, so it applies what every receiver applies.
        A message that negates a held row takes that row back."""
        if not self.config.round_sized:
            count = self.engine.accumulate(messages)
            self.engine.commit()
            return count
        # A round's rows are never changed in place: a changed round gets a new dict, so
        # `save_state` copies the outer dict only, not every round the weights hold.
        before = {t: self.held.get(t, {}) for t in {m.round for m in messages}}
        after = {t: dict(rows) for t, rows in before.items()}
        for m in messages:
            rows = after[m.round]
            if rows.get(m.peer) == m.negated().scalars:
                del rows[m.peer]  # taken back (a ban, an equivocation, an audit's trial)
            else:
                rows[m.peer] = m.scalars
        for round_, old in sorted(before.items()):
            new = after[round_]
            if new:
                self.held[round_] = new
            else:
                self.held.pop(round_, None)
            # Every row of the round moves from its old size to its new one: added at the
            # new size (if held now), taken back at the old one (if held before).
            added = [UpdateMessage(round_, p, g) for p, g in sorted(new.items())]
            taken = [UpdateMessage(round_, p, g).negated() for p, g in sorted(old.items())]
            if step_divisor(self.config, len(old)) == step_divisor(self.config, len(new)):
                # same step size: only the rows that changed
                added = [m for m in added if old.get(m.peer) != m.scalars]
                taken = [m for m in taken if new.get(m.peer) != m.negated().scalars]
            self.engine.accumulate(added, {round_: len(new)})
            self.engine.accumulate(taken, {round_: len(old)})
        self.engine.commit()
        return len(messages)

    def hold(self, messages: Iterable[UpdateMessage]) -> None:
        """Record `messages` as what the weights hold (they were put there by a replay or a
        checkpoint), so later rows of their rounds re-scale them (a round-sized step rule)."""
        if self.config.round_sized:
            self.held = {}
            for m in messages:
                self.held.setdefault(m.round, {})[m.peer] = m.scalars

    def advance(self, head: int) -> None:
        """Make the weights the state of round `head`: under momentum the velocity carried
        on to it (a round without rows still moves the model); otherwise nothing."""
        if self.config.momentum:
            self.engine.advance(head)
            self.engine.commit()

    def rewind(self, head: int) -> None:
        """Back to the state of round `head`, once the rows of rounds >= head are taken
        back (momentum only: an audit's trial state, peer/state_rewind.py)."""
        if self.config.momentum:
            self.engine.rewind(head)
            self.engine.commit()

    def move_to(self, head: int) -> None:
        """The state of round `head`, back (`rewind`) or on (`advance`) from ours."""
        self.rewind(head)
        self.advance(head)

    @property
    def head(self) -> int | None:
        """The round whose state the weights are under momentum (None without it)."""
        return self.engine.momentum_head

    def save_state(self) -> tuple[dict[str, torch.Tensor], dict, object]:
        """The weights, what they hold and the momentum state, for `load_state` (an
        audit's trial states)."""
        held = dict(self.held)  # its rounds' dicts are never changed in place (`apply`)
        weights = {name: w.clone() for name, w in self.weights().items()}
        return weights, held, self.engine.momentum_state()

    def load_state(self, state: tuple[dict[str, torch.Tensor], dict, object]) -> None:
        weights, held, momentum = state
        self.load_weights(weights)
        self.held = dict(held)
        self.engine.load_momentum_state(momentum)

    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable tensors (everything a checkpoint must hold: the rest is base)."""
        return {m.name: m.weight.detach().cpu().contiguous() for m in self.engine.matrices}

    def sha256(self) -> str:
        from seedflood_p2p.workload.models import weights_sha256

        return weights_sha256(self.model)

    def checkpoint(self, directory: Path, cut: LedgerCut, meta: dict) -> dict:
        """Apply the cut's pending updates, then write weights = base + cut.messages.

        Returns `meta` with what the checkpoint holds: message count, digest, weights hash.
        Updates accepted after the cut stay pending: they are in neither. One pass over
        the cut's rows, kept as ranges (a streamed cut at stop holds no row objects)."""
        self.apply(cut.unapplied)
        weights = self.weights()
        momentum = self.engine.momentum_state()
        if momentum is not None:  # the velocity and its round, hashed with the weights
            weights[VELOCITY] = torch.from_numpy(momentum[1].copy())
            meta = {**meta, "momentum_head": momentum[0]}
        digest, ranges = RunningDigest(), CutEncoder()
        for m in cut.messages:
            digest.add(m)
            ranges.add(m.peer, m.round)
        meta = {
            **meta,
            "ledger_messages": digest.count,
            "ledger_digest": digest.hexdigest(),
            "ledger_cut": ranges.encoded(),
            "weights_sha256": tensors_sha256(weights),
            "model_sha256": self.sha256(),
        }
        write_checkpoint(directory, weights, meta)
        return meta

    def restore(
        self,
        cut: LedgerCut,
        directory: Path | None = None,
        observe: Callable[[UpdateMessage], None] | None = None,
        keep: Callable[[UpdateMessage], bool] | None = None,
    ) -> str:
        """Make the weights base + the rows of `cut.messages` that `keep` (default: all;
        the model must hold the base weights).

        From the checkpoint in `directory` when it is trustworthy for this cut: its tensors
        hash to its `weights_sha256`, and the ledger's rows inside its recorded cut digest
        to its `ledger_digest` (same rows, same scalars); then only the difference is
        applied: the kept rows outside its cut added, the rows inside it that are not kept
        taken back (an audited restart keeps the settled state, lag rounds short of the
        checkpoint written at stop). Otherwise (no checkpoint, damaged, edited, of rows
        the ledger no longer holds as such, or rows to take back under momentum) by replay
        of the kept rows. The cut's unapplied updates are in its messages already, so they
        are dropped here. Returns how, for the log.

        One pass over the cut when the checkpoint holds (digests, and the difference kept)
        or when there is none (the replay); two when it is refused. `observe` sees every
        row of the cut once, in order, in the first pass: a caller's account of what the
        weights hold (the audits' `applied`) without a pass of its own."""
        if directory is not None:
            found = self._checkpoint_in(directory)
            if found is not None:
                meta, covered = found
                diff = self._difference(cut, meta, covered, observe, keep)
                observe = None  # every row seen
                if diff is not None:
                    how = self._restore_from_checkpoint(cut, directory, meta, covered, *diff)
                    if how is not None:
                        return how
        # Under momentum into the live engine, which goes on from the velocity it rebuilds.
        engine = self.engine if self.config.momentum else None
        rows = cut.messages if observe is None else _observed(cut.messages, observe)
        if keep is not None:
            rows = filter(keep, rows)
        count = replay(self.model, self.config, rows, schedule=self.schedule, engine=engine)
        self.hold(cut.messages if keep is None else filter(keep, cut.messages))
        return f"replay of {count} ledger messages"

    def trust(self, meta: dict) -> None:
        """From now on, rows of the link `meta` describes are taken as in the weights
        (`receive` drops them). Called where accepts run, just before the start cut is
        taken, so no row of the link is applied twice; `restore_trusting` then loads it.
        ValueError if the meta has no usable cut."""
        if self.config.round_sized or self.config.momentum:
            raise ValueError(
                "a link cannot be trusted before its rows are held under a round-sized "
                "step rule or momentum (late rows re-scale or re-run the rows it covers)"
            )
        covered = cut_contains(meta["ledger_cut"])
        if len(covered) != meta.get("ledger_messages"):
            raise ValueError("its cut does not hold as many rows as it says")
        self.trusted, self.trusted_meta = covered, meta

    def restore_trusting(
        self,
        cut: LedgerCut,
        directory: Path,
        observe: Callable[[UpdateMessage], None] | None = None,
        keep: Callable[[UpdateMessage], bool] | None = None,
    ) -> str | None:
        """Weights = the link in `directory` (trusted: `trust` was called with its meta)
        + the cut's rows it does not cover that `keep` (default: all; an audited run's
        settled state). The link's own rows are not checked here; the ledger may lack them
        (`check_history` checks them once they arrive). `observe` sees each of the other
        rows once, in order (as in `restore`). None, the weights untouched and `trusted`
        cleared, if its tensors are refused: the caller then syncs the whole history and
        replays."""
        meta, covered = self.trusted_meta, self.trusted
        if meta is None or covered is None:
            raise ValueError("restore_trusting without a trusted link (call trust first)")
        tail, self.trusted_held = [], 0
        for m in cut.messages:
            if (m.peer, m.round) in covered:
                self.trusted_held += 1
                continue
            if observe is not None:
                observe(m)
            if keep is None or keep(m):
                tail.append(m)
        how = self._restore_from_checkpoint(cut, directory, meta, covered, tail, [])
        if how is None:
            self.trusted = self.trusted_meta = None
            return None
        return how.replace("checkpoint of round", "trusted checkpoint of round", 1)

    def check_history(self, rows: Iterable[UpdateMessage]) -> bool | None:
        """With the ledger's rows (`rows`, canonical order): None while it lacks some row
        of the trusted link; True once it holds them all and they digest to the link's
        `ledger_digest` (the trust is then lifted: the model is base + ledger again);
        False when they differ from what the link holds (the caller rebuilds by replay).
        One pass; no trusted link: True."""
        if self.trusted is None or self.trusted_meta is None:
            return True
        return self.history_verdict(*digest_within(rows, self.trusted))

    def history_verdict(self, count: int, digest: str) -> bool | None:
        """`check_history`'s answer from the (count, digest) of the ledger's rows inside
        the trusted cut (`storage.ledger.digest_within`, which a child process may run)."""
        covered, meta = self.trusted, self.trusted_meta
        if covered is None or meta is None:
            return True
        if count < len(covered):
            return None
        return digest == meta["ledger_digest"]

    def end_trust(self) -> None:
        """The trusted link's rows are in the ledger and checked (or the model was rebuilt
        without it): the model is base + ledger again."""
        self.trusted = self.trusted_meta = None

    def _checkpoint_in(self, directory: Path) -> tuple[dict, CutRanges | None] | None:
        """The checkpoint's meta and the rows its cut covers (None: no `ledger_cut`), or
        None when there is none or it cannot be read."""
        try:
            meta = read_checkpoint_meta(directory)
            if not isinstance(meta, dict) or not isinstance(meta.get("ledger_digest"), str):
                raise ValueError("its meta has no ledger_digest")
            covered = cut_contains(meta["ledger_cut"]) if "ledger_cut" in meta else None
        except FileNotFoundError:
            return None  # a fresh peer
        except Exception as exc:  # unreadable: the ledger alone rebuilds the model
            log.warning("checkpoint unreadable (%r): replaying the ledger instead", exc)
            return None
        return meta, covered

    def _difference(
        self,
        cut: LedgerCut,
        meta: dict,
        covered: CutRanges | None,
        observe: Callable[[UpdateMessage], None] | None,
        keep: Callable[[UpdateMessage], bool] | None,
    ) -> tuple[list[UpdateMessage], list[UpdateMessage]] | None:
        """One pass over the cut: (the kept rows the checkpoint lacks, the rows it holds
        that are not kept), or None when it does not match the ledger (replay instead)."""
        kept, inside = RunningDigest(), RunningDigest()
        tail: list[UpdateMessage] = []
        extra: list[UpdateMessage] = []
        for m in cut.messages:
            if observe is not None:
                observe(m)
            wanted = keep is None or keep(m)
            h = row_digest(m)
            if wanted:
                kept.add_hash(h)
            if covered is None:
                continue
            if (m.peer, m.round) in covered:
                inside.add_hash(h)
                if not wanted:
                    extra.append(m)
            elif wanted:
                tail.append(m)
        if meta.get("ledger_digest") == kept.hexdigest():
            return [], []  # a checkpoint of exactly the kept rows
        if covered is None:
            return None  # an older checkpoint of another cut: replay
        if inside.count != len(covered) or inside.hexdigest() != meta["ledger_digest"]:
            log.warning(
                "checkpoint of round %s does not match the ledger (its rows differ or are "
                "missing): refused, replaying the ledger instead",
                meta.get("round"),
            )
            return None
        if extra and self.config.momentum:
            log.info(
                "checkpoint of round %s holds %d rows the state to restore does not: "
                "under momentum they are not taken back, the ledger is replayed instead",
                meta.get("round"),
                len(extra),
            )
            return None
        return tail, extra

    def _restore_from_checkpoint(
        self,
        cut: LedgerCut,
        directory: Path,
        meta: dict,
        covered: CutRanges | None,
        tail: list[UpdateMessage],
        extra: list[UpdateMessage],
    ) -> str | None:
        """Load the checkpoint that `_difference` matched, add `tail` and take back `extra`;
        None if its weights are refused (replay instead)."""
        try:
            weights = read_checkpoint_weights(directory, self._device())
        except Exception as exc:  # unreadable: the ledger alone rebuilds the model
            log.warning("checkpoint unreadable (%r): replaying the ledger instead", exc)
            return None
        if "weights_sha256" in meta and tensors_sha256(weights) != meta["weights_sha256"]:
            log.warning(
                "checkpoint of round %s: its weights do not hash as recorded (damaged or "
                "edited): refused, replaying the ledger instead",
                meta.get("round"),
            )
            return None
        velocity = weights.pop(VELOCITY, None)
        if self.config.momentum and (velocity is None or "momentum_head" not in meta):
            log.warning(
                "checkpoint of round %s has no momentum state: replaying", meta.get("round")
            )
            return None
        # Each checks every shape before it writes anything; a refusal leaves the base
        # weights and the momentum state as they were, for the replay that follows.
        before = self.engine.momentum_state()
        try:
            if self.config.momentum:
                head = int(meta["momentum_head"])
                self.engine.load_momentum_state((head, velocity.double().numpy()))
            try:
                self.load_weights(weights)
            except Exception:
                self.engine.load_momentum_state(before)
                raise
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("checkpoint unreadable (%r): replaying the ledger instead", exc)
            return None
        # the difference, in canonical order (its keys are distinct: outside and inside)
        change = sorted([*tail, *(m.negated() for m in extra)], key=lambda m: (m.round, m.peer))
        if self.config.round_sized:  # the difference re-scales the rounds it joins
            if tail or extra:
                self.hold(m for m in cut.messages if (m.peer, m.round) in covered)
            else:
                self.hold(cut.messages)
            self.apply(change)
        else:
            # In canonical order with replay's grouped merges: one pass over the weights
            # per MERGE_GROUP epochs, where `apply` would merge each epoch on its own.
            engine = self.engine if self.config.momentum else None
            replay(self.model, self.config, change, schedule=self.schedule, engine=engine)
        how = f"checkpoint of round {meta.get('round')}"
        if tail:
            how += f" + {len(tail)} ledger messages after it"
        if extra:
            how += f" - {len(extra)} it holds that this state does not"
        return how

    @property
    def schedule(self) -> BasisSchedule | None:
        """The engine's basis artifacts: a replay here applies the same V sides."""
        return getattr(self.engine, "schedule", None)

    def _device(self) -> torch.device:
        return self.engine.matrices[0].weight.device

    @torch.no_grad()
    def shift(self, delta: dict[str, torch.Tensor]) -> None:
        """Add `delta` to the trainable weights: a model restored from a checkpoint whose
        tensors were off by `delta` (peer/latejoin.py `check_weights`, audited runs)."""
        for matrix in self.engine.matrices:  # in float32 at least, rounded once
            w = matrix.weight
            moved = w.float() + delta[matrix.name].to(w.device, torch.float32)
            w.copy_(moved.to(w.dtype))

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # Check every tensor before writing any: a bad file must leave the base weights
        # untouched, since the replay that follows starts from them.
        for matrix in self.engine.matrices:
            if weights[matrix.name].shape != matrix.weight.shape:
                raise ValueError(f"{matrix.name} has shape {weights[matrix.name].shape}")
        for matrix in self.engine.matrices:
            matrix.weight.copy_(weights[matrix.name])


def _observed(
    rows: Iterable[UpdateMessage], observe: Callable[[UpdateMessage], None]
) -> Iterator[UpdateMessage]:
    """`rows`, each shown to `observe` as it passes."""
    for m in rows:
        observe(m)
        yield m
