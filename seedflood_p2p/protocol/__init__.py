"""Protocol: the update message and one module per message family, each stating its wire
format and validation rules at its top. `message.py` holds the update and audit records
and their float16 scalars; `framing.py` what every message shares (msgpack framing, run
tag, topics, `Rejected` and the drop reasons, the integer rule); `update.py` the gossiped
update and every rule it must pass (round window, quorum reference, sender rate,
duplicates and equivocation, repaired envelopes); `audit_record.py` the gossiped audit
record; `repair.py` anti-entropy digests, fetched rows and their budgets; `summary.py`
peer exchange; `checkpoint.py` checkpoint offers and chunks; `held_state.py` the
held-state digest an update carries."""
