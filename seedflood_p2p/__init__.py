"""SeedFlood-P2P: decentralized zeroth-order fine-tuning with SubCGE over libp2p.

The package is layered. Each subpackage is one layer, and a module imports only
from its own layer or from layers below it, never from one above, and never from
the daemons (`peer/`, `bootstrap/`), which sit on top of all of them. `LAYERS`
below is the one place the order is stated; `tools/import_graph.py` reads it and
fails on an upward import or an import cycle (the tests run it).
"""

__version__ = "0.2.0"

# Lowest first. The top-level packages `peer` and `bootstrap` form the layer above
# the last one ("daemon"): the only code that wires a network node to a model.
LAYERS = (
    "core",  # errors, run settings (config), flags and TOML, logging
    "protocol",  # the update message, wire format and validation rules
    "storage",  # the durable SQLite ledger
    "workload",  # models, data sets and the pinned assets they come from
    "algorithm",  # Philox RNG, trainable matrices, SubCGE, objective, step, replay
    "network",  # p2pd transport, flood + repair node, its metrics and status server
    "sim",  # the discrete-round simulator and its gossip baselines
    "apps",  # the `seedflood` command, demo, status, local process launcher
)
