"""Monitoring: a node's counters and gauges for Prometheus and its JSON status page
(`metrics.py`), and the run page a browser shows (`runpage.py`, `run_page.html`). It reads
the ledger and the protocol's drop reasons; it imports no other network room."""
