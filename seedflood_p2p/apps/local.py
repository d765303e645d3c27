"""`seedflood train`, `eval` and `replay`: the model on this machine, no network.

`train` runs simulated peers in one process with the same estimator, step and
ledger as the daemons; `replay` rebuilds a model from base weights plus a ledger.
torch and the model code are imported inside each command, so that building the
parser (for --help) stays fast.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from seedflood_p2p.core.config import MAX_ROUND, RunConfig
from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.flags import add_run_flags, run_config_from_args

log = logging.getLogger("seedflood")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, {"n_ref": "--peers"})
    parser.add_argument("--peers", type=int, default=1, help="simulated peers (default 1)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--ledger", type=Path, help="ledger file (default OUT/ledger.sqlite)")
    parser.add_argument("--out", type=Path, help="output directory (default runs/RUN_ID)")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    parser.add_argument("model_path", nargs="?", help="model directory or name (default --model)")
    parser.add_argument("--examples", type=int, default=1000)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--base", help="base model (default: the run's model)")
    parser.add_argument("--out", type=Path, required=True)


def cmd_train(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.basis import load_schedule
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.algorithm.trainer import evaluate_metrics, format_metrics, train_local
    from seedflood_p2p.storage.artifacts import save_basis
    from seedflood_p2p.storage.ledger import Ledger
    from seedflood_p2p.workload.data import examples_sha256
    from seedflood_p2p.workload.models import load_model, save_model, weights_sha256
    from seedflood_p2p.workload.tasks import load_run_task

    config = run_config_from_args(args)
    model, tokenizer = load_model(config.model)
    task = load_run_task(config)
    config = config.replace(
        base_sha256=weights_sha256(model),
        dataset_sha256=examples_sha256(task),
        n_ref=args.peers if getattr(args, "n_ref", None) is None else config.n_ref,
    )
    out = Path(args.out or f"runs/{config.run_id[:12]}")
    out.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(args.ledger or out / "ledger.sqlite", config.run_id)
    ledger.claim(config, "use another --out or --ledger")
    engine = make_estimator(model, config)
    log.info(
        "run %s: model %s (%.1fM trainable params in %d matrices), dataset %s "
        "(%d train / %d test), %d simulated peers, %d rounds, estimator %s",
        config.run_id[:12],
        config.model,
        engine.num_parameters / 1e6,
        len(engine.matrices),
        config.dataset,
        len(task.train),
        len(task.test),
        args.peers,
        args.rounds,
        config.estimator,
    )
    schedule = load_schedule(ledger)
    for first_epoch, sha in schedule.entries:
        engine.add_basis(first_epoch, schedule.artifacts[sha])
    if len(ledger):
        from seedflood_p2p.algorithm.replay import replay

        log.info("resuming: replaying %d ledger messages", len(ledger))
        # into the training engine: under momentum it keeps the velocity to go on from
        replay(model, config, ledger.messages(), schedule=schedule, engine=engine)
    log.info(
        "start: held-out %s",
        format_metrics(evaluate_metrics(model, tokenizer, task, config, args.eval_examples)),
    )
    started = time.perf_counter()

    def show(r) -> None:
        line = f"round {r.round + 1}/{args.rounds}  train loss {r.train_loss:.4f}"
        if r.eval_loss is not None:
            line += f"  eval loss {r.eval_loss:.4f}"
        if r.eval_accuracy is not None:
            line += f"  accuracy {r.eval_accuracy:.3f}"
        log.info("%s  (%.2f s/round)", line, r.seconds)

    train_local(
        engine,
        tokenizer,
        task,
        peers=args.peers,
        rounds=args.rounds,
        ledger=ledger,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        on_round=show,
        on_basis=lambda epoch, artifact: save_basis(ledger, epoch, artifact),
    )
    engine.close()
    metrics = evaluate_metrics(model, tokenizer, task, config, args.eval_examples)
    log.info("end: held-out %s", format_metrics(metrics))
    save_model(model, tokenizer, out / "model")
    log.info(
        "done in %.1f s: %d messages in %s; model saved to %s; weights sha256 %s",
        time.perf_counter() - started,
        len(ledger),
        ledger.path,
        out / "model",
        weights_sha256(model),
    )
    ledger.close()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.trainer import evaluate_metrics, format_metrics
    from seedflood_p2p.workload.models import load_model
    from seedflood_p2p.workload.tasks import load_run_task

    config = run_config_from_args(args)
    model, tokenizer = load_model(args.model_path or config.model)
    task = load_run_task(config)
    metrics = evaluate_metrics(model, tokenizer, task, config, args.examples)
    shown = min(args.examples, len(task.test))
    print(f"{config.dataset}: {shown} held-out examples  {format_metrics(metrics)}")
    return 0


def counted_updates(ledger, config: RunConfig) -> tuple[list, object]:
    """The ledger's updates that count for the model, in canonical order, and the standing
    they come from: verdicts and probation first (a banned peer's updates are void, a
    probationer's count only where vouched: algorithm/probation.py:standing). What replay
    and export both rebuild."""
    from seedflood_p2p.algorithm.probation import standing_of_ledger

    judged = standing_of_ledger(ledger, config.audit, config.probation)
    return list(judged.counted(ledger.messages())), judged


def check_revocations(ledger, config: RunConfig) -> None:
    """Every ticket revocation in a ledger file must carry the run creator's signature: a
    forged one would void an honest peer's updates in every replay."""
    from seedflood_p2p.network.peers.tickets import check_revocation, decode_revocation
    from seedflood_p2p.storage.ledger import peer_name

    for holder, round_, data in ledger.revocations():
        try:
            revocation = decode_revocation(data)
        except UserError as exc:
            problem: str | None = str(exc)
        else:
            problem = None
            if (revocation.peer, revocation.round) != (holder, round_):
                problem = "differs from the revocation it holds"
            elif config.join.creator is None:
                problem = "is in a run without tickets"
            else:
                problem = check_revocation(revocation, config, config.join.creator)
        if problem is not None:
            raise UserError(
                f"ledger {ledger.path}: ticket revocation (peer {peer_name(holder)}, round "
                f"{round_}) {problem}: the file was altered or damaged; replay a copy from a "
                "peer whose ledger checks out"
            )


def cmd_replay(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.basis import load_schedule
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.storage.ledger import Ledger, peer_name
    from seedflood_p2p.workload.models import load_model, save_model, weights_sha256

    ledger = Ledger.open_existing(args.ledger)
    config = ledger.config
    check = ledger.verify(
        verify_pubsub_signature,
        "replay a copy from a peer whose ledger checks out",
        directions=config.directions,
    )
    log.info(
        "ledger checked in %.2f s: %d signed rows verified, %d rows without a signed envelope "
        "(from %d peer(s): local training or the writer's own unpublished updates)",
        check.seconds,
        check.signed,
        check.unsigned,
        check.unsigned_peers,
    )
    check_revocations(ledger, config)
    model, tokenizer = load_model(args.base or config.model)
    base_hash = weights_sha256(model)
    if config.base_sha256 and base_hash != config.base_sha256:
        raise UserError(
            f"base weights '{args.base or config.model}' have SHA-256 {base_hash[:16]}..., but "
            f"the run was trained from {config.base_sha256[:16]}...: pass the run's base model"
        )
    started = time.perf_counter()
    total = len(ledger)

    def progress(done: int, epoch: int) -> None:
        log.info("replayed %d/%d messages (epoch %d)", done, total, epoch)

    messages, judged = counted_updates(ledger, config)
    for peer, why in sorted(judged.banned.items()):
        log.warning("peer %s is banned (%s): its updates are void", peer_name(peer), why)
    if judged.enabled:
        log.info(
            "probation: %d established identities, %d on probation; %d of %d updates count",
            len(judged.established),
            len(judged.probationers),
            len(messages),
            total,
        )
    count = replay(
        model,
        config,
        messages,
        progress=progress if total > 50_000 else None,
        schedule=load_schedule(ledger),
    )
    save_model(model, tokenizer, args.out)
    digest = weights_sha256(model)
    log.info(
        "replayed %d messages of run %s in %.2f s; model written to %s",
        count,
        config.run_id[:12],
        time.perf_counter() - started,
        args.out,
    )
    print(digest)
    return 0


def add_id_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        default="seedflood-peer",
        help="the peer's data directory (`seedflood peer --data-dir`; default seedflood-peer)",
    )


def cmd_id(args: argparse.Namespace) -> int:
    """Print the peer id of DATA_DIR/identity.key, the key `seedflood peer --data-dir
    DATA_DIR` signs with, creating the directory and a new Ed25519 key if there is none:
    what a run creator lists in `--founders` or signs a ticket for."""
    from pathlib import Path

    from seedflood_p2p.network.transport.identity import load_or_create_identity

    data_dir = Path(args.data_dir).expanduser()
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is a file, not a directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    print(load_or_create_identity(data_dir / "identity.key").to_base58())
    return 0


def add_ticket_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        nargs="?",
        choices=("issue", "revoke"),
        default="issue",
        help="issue a join ticket (the default), or revoke PEER's from --from-round on",
    )
    p.add_argument("--manifest", required=True, help="the run's manifest JSON file")
    p.add_argument("--key", required=True, help="the run creator's identity.key")
    p.add_argument("--peer", required=True, help="the holder's peer id (12D3Koo...)")
    p.add_argument(
        "--until-round",
        type=int,
        default=None,
        help="the holder's updates count in rounds below this one (default: no end)",
    )
    p.add_argument(
        "--from-round",
        type=int,
        default=None,
        help="revoke: the holder's updates of this round and later never count (name a "
        "round ahead of the run; hand the printed text to a node with --revoke)",
    )


def cmd_ticket(args: argparse.Namespace) -> int:
    """Print a join ticket (base58) for PEER in the run of MANIFEST, signed with KEY; or,
    with `revoke`, a revocation of PEER's ticket from --from-round on (for `--revoke`)."""
    from pathlib import Path

    import base58

    from seedflood_p2p.network.peers.tickets import NO_END, check_revocation, issue, revoke
    from seedflood_p2p.network.transport.identity import load_or_create_identity

    try:
        config = RunConfig.from_json(Path(args.manifest).read_bytes())
    except OSError as exc:
        raise UserError(f"cannot read manifest {args.manifest}: {exc.strerror}") from None
    creator = config.join.creator
    if creator is None:
        raise UserError("the run is not ticketed: its manifest has no extra.join.mode = ticketed")
    if not Path(args.key).is_file():
        raise UserError(f"no key file {args.key}")
    if load_or_create_identity(Path(args.key)).to_bytes() != creator:
        raise UserError(f"{args.key} is not the key of the run creator named in the manifest")
    try:
        peer = base58.b58decode(args.peer)
    except ValueError:
        raise UserError("--peer is not a base58 peer id") from None
    if args.action == "revoke":
        if args.from_round is None or not 0 <= args.from_round <= MAX_ROUND:
            raise UserError(f"ticket revoke needs --from-round R, a round in 0..{MAX_ROUND}")
        revocation = revoke(Path(args.key), config, peer, args.from_round)
        if (problem := check_revocation(revocation, config, creator)) is not None:
            raise UserError(f"--peer {args.peer}: cannot revoke its ticket ({problem})")
        print(revocation.text())
        return 0
    if args.from_round is not None:
        raise UserError("--from-round is for `seedflood ticket revoke`")
    if args.until_round is not None and not (0 < args.until_round < NO_END):
        raise UserError(f"--until-round must be a round in 1..{NO_END - 1}")
    expires = NO_END if args.until_round is None else args.until_round
    print(issue(Path(args.key), config, peer, expires).text())
    return 0
