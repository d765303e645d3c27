"""Storage: the durable ledger (SQLite, keyed by run, peer and round)."""
