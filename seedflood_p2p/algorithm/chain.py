"""The run's checkpoint chain: checkpoints every honest peer builds bit for bit alike.

A peer's own checkpoint (live.py) holds its live weights, which differ from every other
peer's by float32 rounding (arrival order), so no two peers could vouch for the same file.
The chain is defined by the ledger alone instead. With P = the manifest's
`extra.checkpoint_every` (rounds; absent or 0: no chain), link j covers every ledger row of
rounds < j*P, and its weights are

    link 0 = the base weights,   link j = link j-1 + replay(rows of rounds in [(j-1)P, jP))

(`replay.replay`: canonical order, its grouped merges, one call per link). Given the same
rows every peer performs the same float32 operations in the same order, so it writes the
same tensors, the same safetensors bytes and the same JSON (`write_link`): joiners take a
link that a quorum of distinct peers offers (network/transfer/checkpoints.py).

A row of an old round may still arrive late (repair). Before building link j from link
j-1, the ledger's rows of rounds < (j-1)P must still digest to link j-1's digest; if they do
not, the chain is rebuilt from the base (the same replays, so again the same bytes as any
peer with those rows). The builder works on a second copy of the model (memory: the
trainable weights twice more, base and scratch), on the model thread, between rounds.

In an audited run (audits on, the default) a peer's model is not base + ledger but a
settled state (probation.py): base + the rows that count by the ledger's records. Link j
there holds the rows of rounds < jP that count in the settled prefix jP + SETTLED_MARGIN
(`SettledCount`), a function of the rows of rounds < jP + SETTLED_MARGIN and the records
that took effect before it, so honest peers again build it alike. The margin is why the
next link can usually still be extended from this one: an honest auditor audits an update
at most MAX_REWIND (30) rounds after its round, so most vouches and establishments that
concern these rows have taken effect. What can still change which of them count: a ban (or
a vouch lost with its voucher's), and a probationer's draw-audit match, which vouches only
from when its author is established, maybe much later. Then the next link is built from
all rows (a joiner restoring from this one takes such rows back or adds them, as an
audited restart does from its own checkpoint).

Each link after the first a process builds costs its period's rows, not the whole ledger
(`ChainTail`): the builder keeps what its newest link stands on (the count, running digest
and cut of the rows below it) and extends that while the ledger still holds exactly those
rows. At ten million rows a link built from all of them took a pass over the ledger
(reading, digesting and cutting every row) every period.
"""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_left
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from seedflood_p2p.algorithm.basis import BasisSchedule
from seedflood_p2p.algorithm.probation import Standing
from seedflood_p2p.algorithm.replay import replay
from seedflood_p2p.algorithm.standing_summary import StandingSummary, summarize
from seedflood_p2p.algorithm.subcge import trainable_tensors
from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.protocol.held_state import MASK, row_hash
from seedflood_p2p.protocol.message import AuditRecord, UpdateMessage
from seedflood_p2p.storage.checkpoint import (
    read_checkpoint_meta,
    read_checkpoint_weights,
    tensors_sha256,
    write_checkpoint,
)
from seedflood_p2p.storage.cut import CutEncoder
from seedflood_p2p.storage.digests import RunningDigest

log = logging.getLogger("seedflood.chain")

CHAIN_DIR = "chain"  # under the data dir
STEP_ROWS = 100_000  # rows a step of a pass over all rows takes (`build_steps`): ~0.1-0.3 s
# Rounds between an audited link's rows and the settled prefix that decides which count:
# beyond peer/state_rewind.py MAX_REWIND (30) plus a peer's lead on the run (max ahead).
# Every builder must use the same value (it is in each link's JSON: `settled_prefix`).
SETTLED_MARGIN = 40
# An audited link's standing summary (standing_summary.py), a uint8 tensor in its file
# beside the weights: the file's hash, which a quorum of offers agrees on, covers it.
STANDING = "standing/summary"


def link_round(round_: int, period: int, settle: int) -> int:
    """The newest link a peer at training round `round_` builds: rows of rounds that ended
    `settle` rounds ago no longer arrive by gossip (the window), so they are settled."""
    if period <= 0:
        return 0
    return max(0, (round_ - settle) // period * period)


def write_link(directory: Path, weights: dict, config: RunConfig, rows: list, round_: int) -> dict:
    """Write link `round_` (the base + `rows`, every row of rounds < round_): its JSON holds
    nothing peer-specific, so equal rows give equal files."""
    return _write(directory, weights, config, round_, ChainTail.of(rows, round_))


@dataclass(frozen=True)
class SettledCount:
    """The rows an audited run's link holds: those that count in the settled prefix `held`
    (`Standing.counts_at`; the link of round R: held = R + SETTLED_MARGIN), by the ledger's
    standing now."""

    standing: Standing
    held: int
    # What the standing was judged on: the records, the claims of the rows they audit and
    # the audit settings. Given them, the link carries its standing summary (`summary`).
    records: tuple[AuditRecord, ...] = ()
    claims: Mapping[tuple[int, bytes], tuple[float, ...]] = field(default_factory=dict)
    settings: AuditSettings | None = None

    def counts(self, m: UpdateMessage) -> bool:
        return self.standing.counts_at(m.peer, m.round, self.held)

    def key(self, below: int) -> tuple:
        """What `counts` reads for the rows of rounds < `below`: two keys that are equal give
        the same answer for every such row (so a link may be extended over them, `extend`).
        Sufficient, not necessary: a difference may still leave the answers alike."""
        held, standing = self.held, self.standing
        span = standing.span(held)  # `BanSpan.count_from` is what `counts` asks
        vouched = frozenset(
            key for key, at in span.vouched_at.items() if at < held and key[1] < below
        )
        # An earned peer's rows of rounds > r_k count by establishment from w_k, and w_k
        # does not grow with k: those counted by `held` are the rounds after the first r_k
        # whose w_k < held. Below `below`, that is one number a peer.
        firsts = {}
        for peer, (rounds, times) in span.steps.items():
            first = next((r for r, w in zip(rounds, times) if w < held), None)
            if first is not None and first < below - 1:
                firsts[peer] = first
        return (
            standing.enabled,
            standing.founders,
            span.banned,
            tuple(sorted(standing.revoked.items())),
            vouched,
            tuple(sorted(firsts.items())),
        )

    def summary(self, below: int, seen: frozenset[bytes]) -> StandingSummary | None:
        """The standing summary of the link of round `below` (the records about its rows
        that took effect in its prefix; `seen`: the peers with rows below it); None
        without what the standing was judged on."""
        if self.settings is None:
            return None
        return summarize(self.claims, self.records, self.settings, below, self.held, seen)


def settled_alike(
    standing: Standing,
    below: int,
    link_held: int,
    held: int,
    peers: frozenset[bytes] | None = None,
) -> bool:
    """Do the rows of rounds < `below` count in the settled prefix `held` as in a link's
    prefix `link_held`, by `standing`? (`SettledCount.key`: sufficient, not necessary.)
    A joiner holding only the rows from that link on may stand on it while they do.
    `peers`: those with rows in the link (its cut). A peer banned in `held` counts no row
    there: its vouches and establishment are then left out of both keys, and unless it has
    rows in the link (`peers`), its ban changes nothing the link holds either. A ban of
    the link's prefix lifted by `held` (a case turned back) always differs."""
    link, now = (SettledCount(standing, h).key(below) for h in (link_held, held))
    banned = now[2]
    if link[2] - banned:  # a ban lifted since: that peer's rows may count, not in the link
        return False

    def counted(key: tuple) -> tuple:
        enabled, founders, bans, revoked, vouched, firsts = key
        return (
            enabled,
            founders,
            bans if peers is None else bans & peers,
            revoked,
            frozenset(k for k in vouched if k[0] not in banned),
            tuple(f for f in firsts if f[0] not in banned),
        )

    return counted(link) == counted(now)


def _counted(rows: list[UpdateMessage], count: SettledCount | None) -> list[UpdateMessage]:
    return rows if count is None else [m for m in rows if count.counts(m)]


def _write(
    directory: Path,
    weights: dict,
    config: RunConfig,
    round_: int,
    below: ChainTail,
    count: SettledCount | None = None,
) -> dict:
    """Link `round_`'s files: its weights and the JSON of the rows `below` it; in an audited
    run also what a joiner trusting it needs (`count`): the held-state digest of its rows
    and the standing summary (its bytes a tensor of the file, STANDING)."""
    summary = None if count is None else count.summary(round_, frozenset(below.peers))
    if summary is not None:
        data = summary.encode()
        weights = {**weights, STANDING: torch.frombuffer(bytearray(data), dtype=torch.uint8)}
    meta = {
        "run_id": config.run_id,
        "round": round_,
        "checkpoint_every": config.checkpoint_every,
        "ledger_messages": below.rows,
        "ledger_digest": below.digest.hexdigest(),
        "ledger_cut": below.cut.encoded(),
        "weights_sha256": tensors_sha256(weights),
    }
    if below.held is not None:  # an audited run's: the rows that count in a settled prefix
        meta["settled_prefix"] = below.held
        meta["held_digest"] = f"{below.held_digest:016x}"  # protocol/held_state.py
    if summary is not None:
        meta["standing_summary"] = {
            "bytes": len(data),
            "matches": len(summary.matches),
            "cases": len(summary.cases),
            "peers": len(summary.seen),
        }
    write_checkpoint(directory, weights, meta)
    return meta


@dataclass
class ChainTail:
    """What a link stands on: the rows of rounds < `round` it holds (their count, running
    digest and cut), the ledger's rows below `round` (`seen`, the rows held among them) and
    its replacement count when they were read (`Ledger.replacements`). The ledger only adds
    rows, or replaces one by the equivocation rule, so while it holds as many rows below
    `round` as then and has replaced none since, it holds these rows. In an audited run,
    `key` is what decided which of them count (`SettledCount.key`)."""

    round: int
    rows: int
    digest: RunningDigest
    cut: CutEncoder
    replaced: int = 0
    seen: int = 0
    key: tuple | None = None
    held: int | None = None  # the settled prefix whose counted rows these are
    # audited runs: the peers with rows below `round` (counted or not: the standing's
    # `seen`) and the held-state digest of the rows it holds (`held_state.state_digest`)
    peers: set[bytes] = field(default_factory=set)
    held_digest: int = 0

    @classmethod
    def of(
        cls,
        rows: list[UpdateMessage],
        round_: int,
        replaced: int = 0,
        count: SettledCount | None = None,
    ) -> ChainTail:
        """The tail of `rows` (canonical order, all of rounds < round_), holding those that
        `count` counts (all without it)."""
        key, held = (None, None) if count is None else (count.key(round_), count.held)
        tail = cls(round_, 0, RunningDigest(), CutEncoder(), replaced, 0, key, held)
        tail.extend(rows, count)
        return tail

    def extend(
        self, rows: list[UpdateMessage], count: SettledCount | None = None
    ) -> list[UpdateMessage]:
        """Add `rows` (canonical order, after those it holds); the ones it holds of them
        (those `count` counts)."""
        held = _counted(rows, count)
        for m in held:
            self.digest.add(m)
            self.cut.add(m.peer, m.round)
        if count is not None:
            self.peers.update(m.peer for m in rows)
            total = self.held_digest
            for m in held:  # a ledger holds one row a key: each key counted once
                total += row_hash(m.peer, m.round)
            self.held_digest = total & MASK
        self.rows += len(held)
        self.seen += len(rows)
        return held

    def copy(self) -> ChainTail:
        return dataclasses.replace(
            self, digest=self.digest.copy(), cut=self.cut.copy(), peers=set(self.peers)
        )


class CheckpointChain:
    """Builds the chain's links into DIRECTORY on a scratch model (base weights at start)."""

    def __init__(
        self,
        scratch: torch.nn.Module,
        config: RunConfig,
        directory: Path,
        schedule: BasisSchedule | None = None,
    ) -> None:
        self.model = scratch
        self.config = config
        self.schedule = schedule  # the run's basis artifacts (None: random bases only)
        self.period = config.checkpoint_every
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.matrices = trainable_tensors(scratch, config)
        self.base = {m.name: m.weight.detach().clone() for m in self.matrices}
        # The newest link built here, while the scratch model holds its weights (None:
        # the next link is built from all rows, `build`).
        self.tail: ChainTail | None = None

    def current(self) -> dict | None:
        """The JSON of the link on disk, or None."""
        try:
            return read_checkpoint_meta(self.directory)
        except (FileNotFoundError, ValueError):
            return None

    def build(
        self,
        rows: list[UpdateMessage],
        target: int,
        replaced: int = 0,
        count: SettledCount | None = None,
    ) -> dict | None:
        """Make the link on disk link `target`; `rows` = the ledger's rows of rounds < target
        (canonical order), read when the ledger's replacement count was `replaced`; in an
        audited run the link holds those that `count` counts. Returns its JSON (None for
        target 0: the base is no link)."""
        steps = self.build_steps(rows, target, replaced, count)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def build_steps(
        self,
        rows: list[UpdateMessage],
        target: int,
        replaced: int = 0,
        count: SettledCount | None = None,
    ) -> Generator[None, None, dict | None]:
        """`build`, a step at a time: it yields after every STEP_ROWS rows of a pass and
        after each period's replay, so that a caller on the model thread lets training run
        between steps (peer/latejoin.py: at ten million rows a build is minutes of work).
        Returns what `build` returns. The scratch model is the builder's until it ends."""
        if target <= 0 or target % self.period:
            return None
        self.tail = None
        tail = ChainTail.of([], target, replaced, count)
        held: list[UpdateMessage] = []
        for low in range(0, len(rows), STEP_ROWS):
            held += tail.extend(rows[low : low + STEP_ROWS], count)
            yield
        meta = self.current()
        start = 0
        if (
            meta is not None
            and meta.get("round", 0) <= target
            and meta.get("settled_prefix") == (None if count is None else count.held)
            and (yield from self._holds(meta, held))
        ):
            self._load(read_checkpoint_weights(self.directory, "cpu"))
            if meta["round"] == target:
                self.tail = tail
                return meta
            start = meta["round"]
        else:
            if meta is not None:
                log.info(
                    "checkpoint chain: link of round %s no longer matches the ledger "
                    "(late rows): rebuilt from the base",
                    meta.get("round"),
                )
            self._load(self.base)
        i = bisect_left([m.round for m in held], start)
        for low in range(start, target, self.period):
            j = i
            while j < len(held) and held[j].round < low + self.period:
                j += 1
            self._replay(held[i:j])
            i = j
            yield
        meta = _write(self.directory, self.weights(), self.config, target, tail, count)
        self.tail = tail
        return meta

    def extend(
        self,
        rows: list[UpdateMessage],
        target: int,
        rows_below: int,
        replaced: int,
        count: SettledCount | None = None,
    ) -> dict | None:
        """Make link `target` from the newest link built here (`tail`) and `rows`, the
        ledger's rows of rounds in [tail round, target); `rows_below`: the ledger's rows of
        rounds < tail round now, `replaced`: its replacement count now, `count`: as for
        `build`. The same tensors and JSON as `build` of all rows (the same replays, in the
        same order, onto the same weights). None when it cannot (no tail, or the rows below
        it changed: a late row or a replacement; in an audited run, a ban, vouch or
        establishment since that changes which of them count): then `build`."""
        tail = self.tail
        if (
            tail is None
            or target <= tail.round
            or target % self.period
            or rows_below != tail.seen
            or replaced != tail.replaced
            or tail.key != (None if count is None else count.key(tail.round))
        ):
            return None
        self.tail = None  # the scratch leaves the tail's weights
        extended = tail.copy()
        extended.round = target
        held = extended.extend(rows, count)
        for low in range(tail.round, target, self.period):
            self._replay([m for m in held if low <= m.round < low + self.period])
        if count is not None:
            extended.key, extended.held = count.key(target), count.held
        meta = _write(self.directory, self.weights(), self.config, target, extended, count)
        self.tail = extended
        return meta

    def _holds(self, meta: dict, rows: list[UpdateMessage]) -> Generator[None, None, bool]:
        """The link on disk is the chain's for these rows (canonical order): same rows below
        its round, and its tensors hash as recorded. Yields every STEP_ROWS rows."""
        digest, below = RunningDigest(), meta["round"]
        for low in range(0, len(rows), STEP_ROWS):
            for m in rows[low : low + STEP_ROWS]:
                if m.round >= below:
                    break
                digest.add(m)
            yield
            if rows[min(low + STEP_ROWS, len(rows)) - 1].round >= below:
                break  # (canonical order: no row below it is left)
        if digest.count != meta.get("ledger_messages") or digest.hexdigest() != meta.get(
            "ledger_digest"
        ):
            return False
        try:
            weights = read_checkpoint_weights(self.directory, "cpu")
        except Exception:
            return False
        return tensors_sha256(weights) == meta.get("weights_sha256")

    # -- rebuilding a fetched link from its rows, a step at a time (a joiner's check) ------
    def reset(self) -> None:
        """The scratch model back to the base weights."""
        self.tail = None
        self._load(self.base)

    def add(self, rows: list[UpdateMessage]) -> None:
        """Replay `rows` (canonical order) onto the scratch model, as a link step does: a
        check calls it once per period, in order, from `reset`, so it makes the same float32
        operations as `build` and ends with the same tensors."""
        self.tail = None
        self._replay(rows)

    def _replay(self, rows: list[UpdateMessage]) -> None:
        replay(self.model, self.config, rows, schedule=self.schedule)

    def weights(self) -> dict[str, torch.Tensor]:
        """The scratch model's trainable tensors, as a link holds them."""
        return {m.name: m.weight.detach().cpu().contiguous() for m in self.matrices}

    @torch.no_grad()
    def _load(self, weights: dict) -> None:
        for m in self.matrices:
            m.weight.copy_(weights[m.name])
