"""Audit records from the network: decode -> validate -> ledger, each counted.

The audit topic (`protocol/audit_record.py:audit_topic_for`) carries signed `AuditRecord`s,
and repair (`network/gossip/repair.py`, `seedflood.audit_digest` / `seedflood.audit_fetch`)
carries the records a peer missed, so every peer ends with the same audit table. Both
sources pass the rules updates pass, through the node's update `Admission` when there is
one: the auditor's key is Ed25519 and in a closed run's allow-list; gossip only: the auditor
is not banned here, keeps to its rate (the update token bucket, shared) and the record's
round is not past the window's upper bound (`out_of_window`); repair only: rounds up to that
bound are fetched, and the envelope's signature and payload
(`audit_record.check_audit_envelope`), skipped for a record already held. A record that
breaks a rule is counted under its reason (`dropped:<reason>`), held against its signer like
a bad update (gossip; repair rows are the server's, see `FloodNode`), logged at most once
per `LOG_EVERY` seconds per reason, and dropped, never raised. Our own records come back
from the daemon signed (`echo`): the envelope is attached to our row, which makes it
repairable by others.

What the records decide (bans, voided updates) is `algorithm/audit_rules.py:judge`, which the
network layer does not import: the caller (a daemon, `peer/audit_duty.py`) judges the ledger
after new records arrive.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

from seedflood_p2p.network.gossip.admission import Admission
from seedflood_p2p.protocol.audit_record import check_audit_envelope, decode_audit
from seedflood_p2p.protocol.framing import Rejected, check_sender_key
from seedflood_p2p.protocol.message import AuditRecord, Envelope
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.audit")
LOG_EVERY = 10.0  # seconds between two log lines for the same drop reason
BAD_ROW_REASONS = ("bad_signature", "mismatch", "bad_key")  # a row no honest server serves


class AuditIntake:
    """One node's audit records: its ledger, the run's k, counters by outcome. With an
    `admission` (a flood node's), its sender rules, rate limits and reputation apply;
    without one (tools, tests), only the Ed25519 key rule."""

    def __init__(
        self,
        ledger: Ledger,
        directions: int,
        admission: Admission | None = None,
        clock=time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.directions = directions
        self.admission = admission
        self.peer_id = admission.peer_id if admission is not None else b""
        self.counts: Counter[str] = Counter()  # accepted, duplicate, echo, dropped:<reason>
        self._clock = clock
        self._last_log: dict[str, float] = {}

    def admit(self, arrivals: list[tuple[bytes, Envelope]]) -> list[AuditRecord]:
        """Records from gossip, each (signer, envelope); returns the ones new to the ledger."""
        records, envelopes, echoes = [], [], []
        for signer, envelope in arrivals:
            try:
                self._check_signer(signer, gossip=True)
                record = decode_audit(envelope.data, self.ledger.run_id, signer, self.directions)
                if self.admission is not None and signer != self.peer_id:  # as for updates
                    self.admission.window.check_ahead(record, self.admission.reference_round())
            except Rejected as exc:
                ours = exc.reason == "out_of_window" and self.admission.behind()  # our lag
                self._drop(exc.reason, str(exc), signer, penalize=not ours)
                continue
            except Exception as exc:  # never let a hostile payload out
                self._drop("malformed", repr(exc), signer, penalize=True)
                continue
            if signer == self.peer_id and signer:
                echoes.append((record, envelope))  # ours, back signed
                continue
            records.append(record)
            envelopes.append(envelope)
        if echoes:
            self.counts["echo"] += self.ledger.set_audit_envelopes(echoes)
            # One of ours we did not log (a lost ledger): logged like anyone's.
            for record, envelope in echoes:
                if not self.ledger.has_audit(record):
                    records.append(record)
                    envelopes.append(envelope)
        fresh = self.ledger.add_audits(records, envelopes) if records else []
        self.counts["accepted"] += len(fresh)
        self.counts["duplicate"] += len(records) - len(fresh)
        return fresh

    def repair(
        self, rows: list[tuple[AuditRecord, Envelope]]
    ) -> tuple[list[AuditRecord], int, list[tuple[int, str]]]:
        """Rows of an audit repair reply (checked whole by the caller). Returns the records
        new to the ledger, how many rows no honest server serves (BAD_ROW_REASONS: a bad
        signature or payload, a key that cannot sign), which the caller holds against the
        server, and (round, reason) of every row dropped."""
        records, envelopes, bad, dropped = [], [], 0, []
        for record, envelope in rows:
            try:
                self._check_signer(record.auditor, gossip=False)
                # a fetch row carries `at` only in its envelope: a copy with a smaller one
                # replaces ours (`Ledger.add_audits`), so it is no duplicate
                try:
                    at = decode_audit(envelope.data, self.ledger.run_id, record.auditor).at
                except Rejected:
                    at = record.at  # `check_audit_envelope` says why, signature first
                if self.ledger.has_audit(dataclasses.replace(record, at=at)):
                    self.counts["repair:duplicate"] += 1
                    continue
                record = check_audit_envelope(record, envelope, self.ledger.run_id, self._verify)
                if record.accused == record.auditor:
                    raise Rejected("self_audit")
                if len(record.scalars) != self.directions:
                    raise Rejected("malformed", f"{len(record.scalars)} scalars")
            except Rejected as exc:
                bad += exc.reason in BAD_ROW_REASONS
                dropped.append((record.round, exc.reason))
                self._drop(exc.reason, str(exc), record.auditor, penalize=False)
                continue
            records.append(record)
            envelopes.append(envelope)
        fresh = self.ledger.add_audits(records, envelopes) if records else []
        self.counts["repair:accepted"] += len(fresh)
        return fresh, bad, dropped

    def own(self, record: AuditRecord) -> bool:
        """Our own record, logged before it is published (unsigned until it echoes)."""
        fresh = self.ledger.add_audits([record])
        self.counts["own"] += len(fresh)
        return bool(fresh)

    def _check_signer(self, signer: bytes, gossip: bool) -> None:
        """The update admission's sender rules for an auditor (see the module docstring)."""
        admission = self.admission
        if admission is None:
            check_sender_key(signer)
            return
        if (problem := admission.sender_problem(signer)) is not None:
            raise problem
        if gossip and signer != self.peer_id:
            if admission.reputation.is_banned(signer):
                raise Rejected("banned")
            if not admission.sender_rate.allow(signer):
                raise Rejected("rate_limited", f"over {admission.sender_rate.rate:g}/s")

    def _verify(self, *args) -> bool:
        if self.admission is not None:
            return self.admission.verify(*args)
        from seedflood_p2p.network.transport.identity import verify_pubsub_signature

        return verify_pubsub_signature(*args)

    def _drop(self, reason: str, text: str, signer: bytes, penalize: bool) -> None:
        self.counts[f"dropped:{reason}"] += 1
        if penalize and self.admission is not None and signer != self.peer_id:
            self.admission.reputation.penalize(signer, reason)
        if reason == "banned":
            return  # expected after a ban: not worth a line
        now = self._clock()
        if now - self._last_log.get(reason, -LOG_EVERY) >= LOG_EVERY:
            self._last_log[reason] = now
            log.warning(
                "dropped audit record from %s: %s (%d so far)",
                signer.hex()[:16],
                text,
                self.counts[f"dropped:{reason}"],
                extra={"fields": {"event": "audit_drop", "reason": reason}},
            )
