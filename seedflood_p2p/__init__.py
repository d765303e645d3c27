"""SeedFlood-P2P: decentralized zeroth-order fine-tuning with SubCGE over libp2p."""

__version__ = "0.1.0"
