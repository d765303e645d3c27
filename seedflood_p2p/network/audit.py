"""Audit records from the network: decode -> validate -> ledger, each counted (issue 11).

The audit topic (`wire.audit_topic_for`) carries signed `AuditRecord`s. Like updates, a
record that breaks a rule is counted under its reason, logged (at most once per
`LOG_EVERY` seconds per reason) and dropped, never raised; a new record is logged to
the ledger's `audits` table. What the records decide (bans, voided updates) is
`algorithm/audit.py:judge`, which the network layer does not import: the caller (a
daemon, `peer/audits.py`) judges the ledger after `admit` returns new records.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from seedflood_p2p.protocol.message import AuditRecord, Envelope
from seedflood_p2p.protocol.wire import Rejected, decode_audit
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.audit")
LOG_EVERY = 10.0  # seconds between two log lines for the same drop reason


class AuditIntake:
    """One node's audit records: its ledger, the run's k, counters by outcome."""

    def __init__(self, ledger: Ledger, directions: int, clock=time.monotonic) -> None:
        self.ledger = ledger
        self.directions = directions
        self.counts: Counter[str] = Counter()  # accepted, duplicate, dropped:<reason>
        self._clock = clock
        self._last_log: dict[str, float] = {}

    def admit(self, arrivals: list[tuple[bytes, Envelope]]) -> list[AuditRecord]:
        """Records from gossip, each (signer, envelope); returns the ones new to the ledger."""
        records, envelopes = [], []
        for signer, envelope in arrivals:
            try:
                record = decode_audit(envelope.data, self.ledger.run_id, signer, self.directions)
            except Rejected as exc:
                self._drop(exc.reason, str(exc), signer)
                continue
            except Exception as exc:  # never let a hostile payload out
                self._drop("malformed", repr(exc), signer)
                continue
            records.append(record)
            envelopes.append(envelope)
        fresh = self.ledger.add_audits(records, envelopes) if records else []
        self.counts["accepted"] += len(fresh)
        self.counts["duplicate"] += len(records) - len(fresh)
        return fresh

    def own(self, record: AuditRecord) -> bool:
        """Our own record, logged before it is published (unsigned until it echoes)."""
        fresh = self.ledger.add_audits([record])
        self.counts["own"] += len(fresh)
        return bool(fresh)

    def _drop(self, reason: str, text: str, signer: bytes) -> None:
        self.counts[f"dropped:{reason}"] += 1
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
