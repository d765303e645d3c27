"""Transport: the go-libp2p daemon (`p2pd.py`), GossipSub over its control socket
(`pubsub.py`), unary request/response calls (`rpc.py`) and a peer's Ed25519 identity
(`identity.py`). It knows bytes and peer ids, not updates; it imports only core."""
