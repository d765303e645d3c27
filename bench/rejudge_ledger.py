"""Judge a ledger's audit records again under today's audit rule and the one before `spread`.

Each audit record holds the auditor's recomputed scalars; the ledger holds the claim. This
prints every record either rule calls a mismatch, with the largest difference against the
recomputation's RMS, and the totals: how a finished run's verdicts would fall under each
rule (issue 45: the demo's first run on the new prompt, before `spread`, convicted an
honest peer on differences of 0.0007 x RMS).

    python bench/rejudge_ledger.py /tmp/demo-p1/peer0/ledger.sqlite
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from seedflood_p2p.core.extra_settings import AuditRule, AuditSettings
from seedflood_p2p.storage.ledger import Ledger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ledger", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # never write the run's own file
        copy = Path(scratch) / "ledger.sqlite"
        shutil.copy(args.ledger, copy)
        ledger = Ledger.open_existing(copy)
        settings = AuditSettings.of(ledger.config.extra)
        rules = {
            "before spread": AuditRule(relative=settings.relative, absolute=settings.absolute),
            "today": settings.rule,
        }
        counts = dict.fromkeys(rules, 0)
        records = ledger.audits()
        for record in records:
            claimed = ledger.scalars_of(record.accused, record.round)
            if claimed is None:
                continue
            verdicts = {
                name: rule.mismatches(claimed, record.scalars) for name, rule in rules.items()
            }
            for name, bad in verdicts.items():
                counts[name] += bad
            if any(verdicts.values()):
                c, r = np.asarray(claimed), np.asarray(record.scalars)
                rms = float(np.sqrt(np.mean(r * r)))
                diff = float(np.abs(c - r).max())
                print(
                    f"round {record.round} accused ...{record.accused[-4:].hex()} by "
                    f"...{record.auditor[-4:].hex()}: max |c - r| {diff:.4f}, RMS {rms:.3f} "
                    f"({diff / rms:.4f} x RMS); "
                    + ", ".join(f"{k}: {'mismatch' if v else 'match'}" for k, v in verdicts.items())
                )
        ledger.close()
    print(
        f"{len(records)} audit records; mismatches "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )


if __name__ == "__main__":
    main()
