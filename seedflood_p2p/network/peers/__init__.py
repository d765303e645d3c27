"""Peers: who the others are and whether to trust them. Discovery records in the DHT
(`discovery.py`), the peers met and heard of (`peer_book.py`), redialling with backoff
(`reconnect.py`) and its views of links and islands (`links.py`, `islands.py`), the
summary exchange that finds what a link lacks (`summaries.py`), join tickets and their
revocations (`tickets.py`), and reputation, bans and per-peer rate limits (`reputation.py`).
It may import transport and monitoring."""
