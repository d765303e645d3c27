"""A hostile participant for integration tests: one identity on its own real p2pd daemon,
using the project's own transport and signing (its updates are validly signed GossipSub
messages, exactly what an honest peer's daemon sends), running these attacks:

    flood        valid signed updates with scalar +-100 on fresh rounds, spread far
                 behind and ahead of the run's round, as fast as the daemon publishes
    walk         one update every step of +50 rounds past the run's round (the window
                 walk that moved the newest round 63 -> 5063)
    equivocate   two different signed updates for one round
    stall        a valid update for a round a few behind the run every few seconds (a
                 live peer that never keeps pace: peers wait for it at most once)
    tarpit       repair answers: a digest claiming 2,000 differing buckets, fetches
                 answered after 8 s, then pages of well-formed rows with bad signatures

It runs in a thread with its own event loop; `phases` says which attacks and in what
order. `report` counts what it sent. The run's round is read from the gossip it hears.
"""

from __future__ import annotations

import asyncio
import random
import threading

import msgpack

from seedflood_p2p.network.transport.p2pd import create_p2p
from seedflood_p2p.network.transport.pubsub import PubSubClient
from seedflood_p2p.network.transport.rpc import serve_bytes
from seedflood_p2p.protocol.framing import topic_for
from seedflood_p2p.protocol.message import pack_scalars
from seedflood_p2p.protocol.repair import BUCKET_ROUNDS
from seedflood_p2p.protocol.update import decode_update, encode_update

TARPIT_SECONDS = 8.0


class Hostile(threading.Thread):
    def __init__(
        self, bootstrap: str, run_id: str, phases: list[str], min_peers: int = 3, seed: int = 0
    ) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.run_id, self.phases = bootstrap, run_id, phases
        self.min_peers = min_peers
        self.rng = random.Random(seed)
        self.ready, self.finished, self.done = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self.peer_id: bytes = b""
        self.rounds: dict[bytes, int] = {}  # newest round heard from each other sender
        self.report = {"published": 0, "digest_requests": 0, "fetch_requests": 0}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc
        finally:
            self.ready.set()
            self.finished.set()

    @property
    def run_round(self) -> int:
        """The run's round as the median sender has it (other attackers do not move it)."""
        ordered = sorted(self.rounds.values())
        return ordered[(len(ordered) - 1) // 2] if ordered else -1

    # -- repair tarpit ------------------------------------------------------------------
    async def _digest(self, peer, request: bytes) -> bytes:
        self.report["digest_requests"] += 1
        claims = [[b, 50, self.rng.randbytes(32)] for b in range(2000)]
        return msgpack.packb(claims, use_bin_type=True)

    async def _fetch(self, peer, request: bytes) -> bytes:
        self.report["fetch_requests"] += 1
        _, after_round, _, max_round, limit = msgpack.unpackb(request)
        if self.report["fetch_requests"] <= 3:
            await asyncio.sleep(TARPIT_SECONDS)
        first = max(after_round + 1, max_round - 3)
        rows = [
            [
                r,
                self.peer_id,
                pack_scalars((0.5,)),
                encode_update(self.run_id, r, (0.5,)),
                r.to_bytes(8, "big"),
                self.rng.randbytes(64),
            ]  # a signature that does not verify
            for r in range(first, max_round + 1)
        ][:limit]
        return msgpack.packb(rows, use_bin_type=True)

    # -- gossip -------------------------------------------------------------------------
    async def _listen(self, subscription) -> None:
        async for item in subscription:
            if item.sender == self.peer_id:
                continue
            try:
                message = decode_update(item.data, self.run_id, item.sender)
            except Exception:
                continue
            self.rounds[item.sender] = max(self.rounds.get(item.sender, -1), message.round)

    async def _publish(self, client: PubSubClient, round_: int, scalar: float) -> None:
        await client.publish(self.topic, encode_update(self.run_id, max(round_, 0), (scalar,)))
        self.report["published"] += 1

    async def _flood(self, client: PubSubClient) -> None:
        base = self.run_round
        rounds = list(range(max(0, base - 200), base + 200))
        self.rng.shuffle(rounds)
        for round_ in rounds[:400]:
            await self._publish(client, round_, self.rng.choice((100.0, -100.0)))

    async def _walk(self, client: PubSubClient) -> None:
        for step in range(1, 101):
            await self._publish(client, self.run_round + 50 * step, 100.0)

    async def _equivocate(self, client: PubSubClient) -> None:
        round_ = self.run_round + 1
        await self._publish(client, round_, 0.5)
        await asyncio.sleep(1.0)
        await self._publish(client, round_, -0.5)

    async def _stall(self, client: PubSubClient) -> None:
        """A live peer whose round stays a few behind the run's, heard every 3 s."""
        sent = set()
        while not self.done.is_set():
            round_ = self.run_round - 4
            if round_ >= 0 and round_ not in sent:
                await self._publish(client, round_, 0.01)
                sent.add(round_)
            await asyncio.sleep(3.0)

    async def _main(self) -> None:
        p2p = await create_p2p(
            identity_path=None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[self.bootstrap]
        )
        self.peer_id = p2p.peer_id.to_bytes()
        self.topic = topic_for(self.run_id)
        client = PubSubClient(p2p, max_rate=500, burst=50)
        listener = None
        try:
            if "tarpit" in self.phases:
                await serve_bytes(p2p, "seedflood.digest", self._digest)
                await serve_bytes(p2p, "seedflood.fetch", self._fetch)
            subscription = await client.subscribe(self.topic)
            listener = asyncio.create_task(self._listen(subscription))
            for _ in range(300):
                if (
                    len(await client.list_peers(self.topic)) >= self.min_peers
                    and self.run_round > 2
                ):
                    break
                await asyncio.sleep(0.2)
            self.ready.set()
            for phase in self.phases:
                if phase in ("flood", "walk", "equivocate", "stall"):
                    await getattr(self, "_" + phase)(client)
            self.finished.set()
            while not self.done.is_set():
                await asyncio.sleep(0.2)
        finally:
            if listener is not None:
                listener.cancel()
            await client.close()
            await p2p.shutdown()


__all__ = ["BUCKET_ROUNDS", "Hostile"]
