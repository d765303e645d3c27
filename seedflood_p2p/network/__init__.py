"""Network: everything a node does on the wire, and nothing that touches a model.

It is split into rooms, one concept each, lowest first (`ROOMS`; `tools/import_graph.py`
fails on an import up a room, as it does on one up a layer):

- `transport/`: the go-libp2p daemon (p2pd), GossipSub, request/response, identities.
- `monitoring/`: a node's counters (Prometheus and JSON status) and the run page.
- `peers/`: who the others are: discovery, redialling, join tickets, reputation and bans.
- `transfer/`: files fetched by digest in chunks: run assets and checkpoints.
- `settings.py`: a node's network settings (`NodeSettings`).
- `gossip/`: the flood core: admission (validate, log), repair, audit-record intake.
- `host.py`: one network host wired from the rooms above.
"""

ROOMS = ("transport", "monitoring", "peers", "transfer", "settings", "gossip", "host")
