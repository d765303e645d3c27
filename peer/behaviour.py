"""How a peer acts at the few points where a test makes one misbehave on purpose.

    update        the update it publishes for a round, given the honest one it trained
    served link   the checkpoint-chain link it offers joiners, given the one it built
    served chunk  a chunk of that link as it sends it
    hears         whether it takes in the next gossip message from another peer

The daemon (`PeerDaemon(settings, behaviour)`) consults its `Behaviour` there and
nowhere else. The product only ever builds the honest one below: no flag, setting or
environment variable of `seedflood peer` changes it. The tests' misbehaving peer is a
subclass, run as its own program (harness/hooked_peer.py).
"""

from __future__ import annotations

from pathlib import Path

from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger


class Behaviour:
    """An honest peer: every method passes on what it is given."""

    def update(self, message: UpdateMessage, ledger: Ledger) -> UpdateMessage:
        """The update to publish, for the honest `message` (`ledger`: this peer's)."""
        return message

    async def served_link(self, directory: Path) -> Path:
        """The checkpoint directory to offer, for the chain link built in `directory`."""
        return directory

    def served_chunk(self, data: bytes) -> bytes:
        """A checkpoint chunk as it is sent, for the bytes of the offered file."""
        return data

    def hears(self) -> bool:
        """Whether to take in the next gossip message from another peer."""
        return True
