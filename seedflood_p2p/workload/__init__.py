"""Workload: models, data sets, and the hash-pinned assets they are built from."""
