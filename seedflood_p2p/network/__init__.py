"""Network: the p2pd transport, the flood node (flood, validate, ledger, repair), its metrics."""
