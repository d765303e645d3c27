"""Gossip: the flood core. Every update and audit record enters through admission
(`admission.py`: validate, then log); `flood.py` publishes and receives over GossipSub;
`repair.py` heals gaps by anti-entropy; `audit_intake.py` takes audit records off the wire.
It may import every room below it."""
