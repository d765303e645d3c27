"""Simulator: many virtual peers in one process, SeedFlood against gossip baselines."""
