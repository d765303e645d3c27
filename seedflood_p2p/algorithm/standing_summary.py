"""What the audit records below an audited link say, in the few bytes the standing reads.

A joiner that trusts an audited run's link (chain.py: a settled state, base + the rows of
rounds < R that count in the settled prefix H = R + SETTLED_MARGIN) and syncs only the rows
from R on still needs the run's standing (probation.py) to know which of those rows count
and who is banned. The standing reads, of the ledger, the claims of the rows its audit
records audit and, per (accused, round, auditor), one record (`choose_records`); and of
those:

    a case with a mismatch   everything: its claim and every record (`judge`, `ban_spans`)
    any other case           only who vouched and from when: (accused, round, auditor,
                             effective round) per matching record (`_matches`); a record
                             about a row the ledger lacks, nothing

So `summarize` keeps, of the records about rows of rounds < `below` that took effect
before `held`, the cases with a mismatch whole and the other matches as 4-tuples, with the
peers that have rows below `below` (the standing's `seen`). `inputs` turns a summary and the
joiner's own rows and records (those of rounds >= `below`) back into arguments of
`probation.standing`; a matching record is given as a record whose scalars equal a stand-in
claim (the rule reads only whether they match). When the ledger holds no other record about
those rows (honest auditors audit within MAX_REWIND rounds of an update, so every honest
record of a row below the link took effect before its settled prefix), the standing of the
inputs is the standing of the whole ledger (tests/test_standing_summary.py checks it on
random ledgers): a pure function of the ledger prefix every builder holds, so builders
write the same bytes (`encode`), and a joiner takes the summary a quorum offers with the
link, as it takes the link's weights. A late record about a row below the link is the
case it cannot judge: that waits for the history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgpack

from seedflood_p2p.algorithm.audit_rules import choose_records
from seedflood_p2p.algorithm.probation import effective_round
from seedflood_p2p.core.extra_settings import AuditSettings
from seedflood_p2p.protocol.message import AuditRecord

STAND_IN = (0.0,)  # the claim and the scalars of a summarized match: the rule says "match"
FORMAT = 1


@dataclass(frozen=True)
class StandingSummary:
    """The records about rows of rounds < `below` that took effect before `held`, as the
    standing reads them (module docstring)."""

    below: int
    held: int
    # (accused, round, auditor, effective round) of each match in a case without a mismatch
    matches: tuple[tuple[bytes, int, bytes, int], ...]
    # (claim, records) of each case with a mismatch: the claim of (accused, round) and
    # every chosen record about it
    cases: tuple[tuple[tuple[float, ...], tuple[AuditRecord, ...]], ...]
    seen: frozenset[bytes]  # the peers with rows of rounds < below

    def inputs(
        self,
        claims: Mapping[tuple[int, bytes], tuple[float, ...]],
        records: Iterable[AuditRecord],
        seen: Iterable[bytes],
    ) -> tuple[dict, list[AuditRecord], frozenset[bytes]]:
        """`probation.standing`'s claims, records and seen: this summary's with the joiner's
        own (`claims`, `records`: of the rows of rounds >= below and the records about them;
        `seen`: the peers of those rows). A record of its own about a row below is left out:
        the summary holds what the prefix says of it (one it does not is the late record's
        case, module docstring)."""
        out_claims = {key: c for key, c in claims.items() if key[0] >= self.below}
        out_records = [r for r in records if r.round >= self.below]
        for accused, round_, auditor, effective in self.matches:
            out_claims.setdefault((round_, accused), STAND_IN)
            out_records.append(AuditRecord(accused, round_, auditor, STAND_IN, effective))
        for claim, case in self.cases:
            out_claims[(case[0].round, case[0].accused)] = claim
            out_records += case
        return out_claims, out_records, frozenset(seen) | self.seen

    # -- bytes: what the link's JSON hashes and a joiner fetches --------------------------
    def encode(self) -> bytes:
        """Canonical bytes (peers by their index in the sorted list of those named): equal
        summaries give equal bytes."""
        peers = sorted(
            self.seen
            | {p for m in self.matches for p in (m[0], m[2])}
            | {p for _, case in self.cases for r in case for p in (r.accused, r.auditor)}
        )
        index = {p: i for i, p in enumerate(peers)}
        return msgpack.packb(
            [
                FORMAT,
                self.below,
                self.held,
                peers,
                [x for a, t, q, e in self.matches for x in (index[a], t, index[q], e)],
                [
                    [list(claim), [[index[r.auditor], list(r.scalars), r.at] for r in case]]
                    + [index[case[0].accused], case[0].round]
                    for claim, case in self.cases
                ],
                sorted(index[p] for p in self.seen),
            ],
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> StandingSummary:
        """The summary `encode` wrote; ValueError naming what is wrong otherwise."""
        try:
            fmt, below, held, peers, flat, cases, seen = msgpack.unpackb(data, raw=False)
            if fmt != FORMAT:
                raise ValueError(f"format {fmt!r}, this version reads {FORMAT}")
            if len(flat) % 4:
                raise ValueError("matches are not 4-tuples")
            matches = tuple(
                (peers[flat[i]], flat[i + 1], peers[flat[i + 2]], flat[i + 3])
                for i in range(0, len(flat), 4)
            )
            decoded = []
            for claim, rows, accused, round_ in cases:
                case = tuple(
                    AuditRecord(peers[accused], round_, peers[q], tuple(s), at) for q, s, at in rows
                )
                if not case:
                    raise ValueError("a case without records")
                decoded.append((tuple(claim), case))
            summary = cls(below, held, matches, tuple(decoded), frozenset(peers[i] for i in seen))
        except Exception as exc:  # malformed msgpack, wrong shapes, bad indices, a format
            raise ValueError(f"not a standing summary: {exc}") from exc
        if summary.encode() != data:  # one encoding per summary: no other bytes pass
            raise ValueError("not the canonical encoding of a standing summary")
        return summary


def summarize(
    claims: Mapping[tuple[int, bytes], tuple[float, ...]],
    records: Iterable[AuditRecord],
    settings: AuditSettings,
    below: int,
    held: int,
    seen: Iterable[bytes],
) -> StandingSummary:
    """The summary of the records about rows of rounds < `below` that took effect before
    `held` (`effective_round`), given the claims of the rows they audit and the peers with
    rows below `below` (`seen`): a function of the ledger prefix H = `held`."""
    rule = settings.rule
    prefix = [r for r in records if r.round < below and effective_round(r, settings) < held]
    by_case: dict[tuple[bytes, int], list[AuditRecord]] = {}
    for (accused, round_, _), record in sorted(choose_records(prefix).items()):
        if (round_, accused) in claims:  # a record about a row the ledger lacks says nothing
            by_case.setdefault((accused, round_), []).append(record)
    matches, cases = [], []
    for (accused, round_), case in sorted(by_case.items()):
        claim = tuple(claims[(round_, accused)])
        if any(rule.mismatches(claim, r.scalars) for r in case):
            cases.append((claim, tuple(case)))
        else:
            matches += [(accused, round_, r.auditor, effective_round(r, settings)) for r in case]
    return StandingSummary(below, held, tuple(matches), tuple(cases), frozenset(seen))
