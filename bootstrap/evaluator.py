"""The bootstrap node's own evaluations for the run page (opt-in: `--page-eval-every N`).

Peers evaluate their own live model but publish neither losses nor evaluations, so no
run-wide held-out figure travels in the run. The bootstrap node can make one without
trusting anybody: it keeps a model equal to base + its ledger (the invariant every peer
keeps, `algorithm/live.py`), fed by the same accepted updates, and every N rounds scores
it on the first held-out examples and on as many training examples. It costs the node
one copy of the model and its forward passes, on one torch thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.network.monitoring.runpage import RunPage
from seedflood_p2p.protocol.message import UpdateMessage
from seedflood_p2p.storage.ledger import Ledger

log = logging.getLogger("seedflood.bootstrap")


class LedgerEvaluator:
    """base + ledger, scored every `every` rounds; results go to the run page."""

    def __init__(self, config: RunConfig, ledger: Ledger, every: int, examples: int) -> None:
        self.config = config
        self.every = every
        self.examples = examples
        # Rows already in the ledger, then every update the flood node accepts (on_accept).
        self.pending: list[UpdateMessage] = list(ledger.messages())
        self.ledger_path = ledger.path  # the run's basis artifact is stored beside it
        self.applied_round = -1  # highest round applied so far
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="page-eval")
        self.live = self.tokenizer = self.task = None

    def receive(self, messages: list[UpdateMessage]) -> None:
        self.pending.extend(messages)

    def _load(self) -> None:
        import torch

        from seedflood_p2p.algorithm.live import LiveModel
        from seedflood_p2p.algorithm.subcge import make_estimator
        from seedflood_p2p.workload.models import load_model, weights_sha256
        from seedflood_p2p.workload.tasks import load_run_task

        torch.set_num_threads(1)  # the node's other work must not starve
        model, self.tokenizer = load_model(self.config.model)
        if self.config.base_sha256 and weights_sha256(model) != self.config.base_sha256:
            raise UserError(
                f"--page-eval-every: the base weights of '{self.config.model}' here differ from "
                "the run's: the model files differ (another revision or a corrupt cache)"
            )
        self.task = load_run_task(self.config)  # the organiser's own files: this node's
        engine = make_estimator(model, self.config)
        if self.config.basis_sha256:
            from seedflood_p2p.algorithm.basis import decode
            from seedflood_p2p.storage.artifacts import ArtifactStore

            body = ArtifactStore.beside(self.ledger_path).get(self.config.basis_sha256)
            engine.add_basis(0, decode(body, self.config.basis_sha256))
        self.live = LiveModel(engine)

    def _score(self, messages: list[UpdateMessage]) -> tuple[float, float | None, float]:
        from seedflood_p2p.algorithm.trainer import evaluate

        if messages:
            self.live.apply(messages)
        loss, accuracy = evaluate(
            self.live.model, self.tokenizer, self.task, self.config, self.examples
        )
        train_task = dataclasses.replace(self.task, test=self.task.train)
        train_loss, _ = evaluate(
            self.live.model, self.tokenizer, train_task, self.config, self.examples
        )
        return loss, accuracy, train_loss

    async def run(
        self,
        page: RunPage,
        newest_round: Callable[[], int],
        on_score: Callable[[float | None], None] = lambda accuracy: None,
        poll: float = 1.0,
    ) -> None:
        """Score base + ledger at start (rounds done: as many as the ledger holds), then
        whenever the run went `every` rounds further, until cancelled; `on_score` gets each
        held-out accuracy (the node's `seedflood_eval_accuracy` gauge)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._thread, self._load)
            last = None
            while True:
                newest = newest_round()
                if last is None or newest >= last + self.every:
                    messages, self.pending = self.pending, []
                    if messages:
                        self.applied_round = max(self.applied_round, *(m.round for m in messages))
                    done = self.applied_round + 1  # rounds done: 0 .. applied_round
                    loss, accuracy, train_loss = await loop.run_in_executor(
                        self._thread, self._score, messages
                    )
                    page.record_eval(done, loss, accuracy, train_loss)
                    on_score(accuracy)
                    log.info(
                        "page eval after %d rounds: loss %.4f%s",
                        done,
                        loss,
                        "" if accuracy is None else f"  accuracy {accuracy:.3f}",
                        extra={
                            "fields": {
                                "event": "eval",
                                "rounds_done": done,
                                "eval_loss": round(loss, 5),
                                "eval_accuracy": accuracy,
                                "train_loss": round(train_loss, 5),
                            }
                        },
                    )
                    last = newest
                await asyncio.sleep(poll)
        except Exception as exc:  # the node goes on serving; the page says why
            log.error("page evaluations stopped: %s", exc)
            page.heldout_source += f"; stopped at this node: {exc}"
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)
