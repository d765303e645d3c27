"""Which probation audits an established peer does each round, within its verification
budget (docs/SYBIL.md): split out of the peer's audit state (peer/audit_duty.py) so the
scheduling reads on its own.

Each round earns `share` audits (an audit, or a retry of one on a late state, costs one
training step), at most two rounds' worth saved up; retries may leave the budget below 0,
and later rounds repay that first. Probationers are served fairly: one audit at a time to
the probationer we spent the fewest probation audits on so far (`served`: round-robin
across rounds, so a newcomer never queues behind keys that came earlier), ties broken by a
draw with our secret (auditors spread differently), each one's updates in an order drawn
with our secret (so auditors spread over different updates). What we cannot afford waits,
counted in `backlog`. Local scheduling only: which audits we do, not what counts.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping

from seedflood_p2p.algorithm.audit_rules import audit_draw
from seedflood_p2p.algorithm.probation import Standing
from seedflood_p2p.core.extra_settings import ProbationSettings
from seedflood_p2p.core.rng import derive_key
from seedflood_p2p.protocol.message import UpdateMessage


class ProbationQueue:
    """One peer's verification budget and its fair queue of probationers' updates."""

    def __init__(self, probation: ProbationSettings) -> None:
        self.probation = probation
        self.tokens = 0.0  # probation audits we may still do (the verification budget)
        self.backlog = 0  # probationers' updates due for a probation audit we had no budget for
        self.waiting_peers = 0  # probationers with such updates
        # Probation audits we spent on each probationer (`jobs` serves the least served
        # first); a key leaves when it stops being a probationer.
        self.served: Counter[bytes] = Counter()

    @staticmethod
    def auditing(st: Standing | None, peer_id: bytes) -> bool:
        """Do we do probation work: probation on, and we are established?"""
        return st is not None and st.enabled and peer_id in st.established

    def earn(self, st: Standing | None, peer_id: bytes) -> None:
        """One round's budget: `share` audits, for an established peer only; at most two
        rounds' worth saved up (below 0: retries still being repaid)."""
        if not self.auditing(st, peer_id):
            return
        share = self.probation.share
        self.tokens = min(self.tokens + share, max(1.0, 2 * share))

    def idle(self) -> list[UpdateMessage]:
        """No probation work this round: nothing waits for us."""
        self.backlog = self.waiting_peers = 0
        return []

    def pay_recheck(self, peer: bytes) -> bool:
        """A re-check of a probationer's update is probation work: paid from the budget if
        it has a whole audit left (True), else it waits (False)."""
        if self.tokens < 1:
            return False
        self.tokens -= 1
        self.served[peer] += 1
        return True

    def pay_retries(self, retries: int) -> None:
        """Retries of a probationer's audit on late states, one training step each: a
        debt later rounds repay (`earn`)."""
        self.tokens -= retries

    def jobs(
        self,
        st: Standing,
        rows: Iterable[UpdateMessage],
        done: set[tuple[bytes, int]],
        secret: bytes,
        run_key: bytes,
        trained_round: int,
    ) -> list[UpdateMessage]:
        """This round's probation audits within the budget, among `rows` (the ledger's
        updates of the rounds due, see `PeerAudits.ready`): the probationers' unvouched
        ones not `done`, least-served probationer first. Each one picked is added to
        `done`; the rest are counted in `backlog`. For an auditing peer (`auditing`) while
        there are probationers (else `idle`)."""
        for peer in set(self.served) - st.probationers:  # established or banned since
            del self.served[peer]
        due: dict[bytes, list[UpdateMessage]] = {}
        for m in rows:
            key = (m.peer, m.round)
            if m.peer in st.probationers and key not in st.vouched and key not in done:
                due.setdefault(m.peer, []).append(m)
        for updates in due.values():  # popped from the end: lowest draw first
            updates.sort(key=lambda m: audit_draw(secret, run_key, m.peer, m.round))
            updates.reverse()
        # the tie draw: ours, and fresh each round (a tie is not always won by one key)
        queue = [
            (
                self.served[p],
                derive_key("seedflood/probation-tie", secret, run_key, p, trained_round),
                p,
            )
            for p in due
        ]
        heapq.heapify(queue)
        picked, budget = [], max(0, int(self.tokens))  # below 0: retries still being repaid
        while queue and len(picked) < budget:
            served, tie, peer = heapq.heappop(queue)
            m = due[peer].pop()
            done.add((m.peer, m.round))
            self.served[peer] += 1
            picked.append(m)
            if due[peer]:
                heapq.heappush(queue, (served + 1, tie, peer))
        self.tokens -= len(picked)
        self.backlog = sum(len(updates) for updates in due.values())
        self.waiting_peers = sum(1 for updates in due.values() if updates)
        return picked

    def status(
        self, st: Standing | None, peer_id: bytes, waiting: int, counts: Mapping[str, int]
    ) -> dict | None:
        """Probation as this peer sees it (None: the run has no founders, probation off);
        `waiting`: updates kept waiting of peers not banned; `counts`: the audit counts."""
        if st is None or not st.enabled:
            return None
        return {
            "established": len(st.established),
            "founders": len(st.founders),
            "earned": len(st.since),
            "on_probation": len(st.probationers),
            "vouched_updates": len(st.vouched),
            "waiting_updates": waiting,
            "counted_late": counts["counted_late"],  # records that reached us late
            "counted_on_time": counts["counted_on_time"],  # at their effective round
            "probation_audits": counts["probation_audits"],
            "probation_retries": counts["probation_retries"],  # paid like audits
            "backlog": self.backlog,
            "backlog_peers": self.waiting_peers,
            "share": self.probation.share,
            "vouches": self.probation.vouches,
            "we_are": "established" if peer_id in st.established else "on probation",
        }
