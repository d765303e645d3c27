"""Peers: who the others are and whether to trust them. Discovery records in the DHT
(`discovery.py`), the peer book and redialling with backoff (`reconnect.py`), join
tickets (`tickets.py`), and reputation, bans and per-peer rate limits (`reputation.py`).
It may import transport and monitoring."""
