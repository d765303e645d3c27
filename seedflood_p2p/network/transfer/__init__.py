"""Transfer: files fetched by digest, chunk by chunk, from several peers at once
(`chunks.py`): the organiser's run assets (`assets.py`) and checkpoints for late joiners
(`checkpoints.py`). It may import transport, monitoring and peers (for per-peer limits)."""
