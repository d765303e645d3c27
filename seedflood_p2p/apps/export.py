"""`seedflood export`: a run's trained model as a Hugging Face directory with a model card.

From a ledger file (base weights + the ledger, replayed as `seedflood replay` does, the
audits' verdicts included) or from a peer's data directory (its latest checkpoint, the
weights it trains on, checked against the hash the checkpoint records). The directory
holds what `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
read (safetensors, config.json, tokenizer files), the run's manifest
(`seedflood_run.json`) and README.md: run id, ledger digest, rounds, held-out figures.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from seedflood_p2p.core.config import RunConfig
from seedflood_p2p.core.errors import UserError

log = logging.getLogger("seedflood.export")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ledger", type=Path, help="a run's ledger file: replayed")
    source.add_argument(
        "--checkpoint", type=Path, help="a peer's data dir: its latest checkpoint's weights"
    )
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--base", type=Path, help="this machine's copy of the base model dir")
    parser.add_argument(
        "--dataset-file", type=Path, help="this machine's copy of the run's data file"
    )
    parser.add_argument("--examples", type=int, default=1000, help="held-out examples scored")


def cmd_export(args: argparse.Namespace) -> int:
    from seedflood_p2p.algorithm.trainer import evaluate_metrics, format_metrics
    from seedflood_p2p.workload.models import save_model, weights_sha256
    from seedflood_p2p.workload.tasks import load_run_task

    if args.ledger is not None:
        model, tokenizer, config, facts = rebuild_from_ledger(args.ledger, args.base)
    else:
        model, tokenizer, config, facts = rebuild_from_checkpoint(args.checkpoint, args.base)
    metrics: dict[str, float] | None = None
    try:
        task = load_run_task(config, str(args.dataset_file) if args.dataset_file else None)
        metrics = evaluate_metrics(model, tokenizer, task, config, args.examples)
        facts["eval_examples"] = min(args.examples, len(task.test))
    except UserError as exc:  # the card says why; the weights are exported all the same
        log.warning("held-out figures not computed: %s", exc)
        facts["eval_skipped"] = str(exc)
    facts["model_sha256"] = weights_sha256(model)
    save_model(model, tokenizer, args.out)
    (args.out / "seedflood_run.json").write_text(
        json.dumps(json.loads(config.to_json()), indent=1, sort_keys=True) + "\n"
    )
    (args.out / "README.md").write_text(model_card(config, facts, metrics))
    shown = "" if metrics is None else f"; held-out {format_metrics(metrics)}"
    log.info("exported run %s to %s%s", config.run_id[:12], args.out, shown)
    print(args.out)
    return 0


def _base_model(config: RunConfig, base: Path | None):
    from seedflood_p2p.workload.models import load_model, weights_sha256

    model, tokenizer = load_model(str(base) if base is not None else config.model)
    digest = weights_sha256(model)
    if config.base_sha256 and digest != config.base_sha256:
        raise UserError(
            f"base weights '{base or config.model}' have SHA-256 {digest[:16]}..., but the "
            f"run was trained from {config.base_sha256[:16]}...: pass the run's base model "
            "with --base"
        )
    return model, tokenizer


def rebuild_from_ledger(path: Path, base: Path | None) -> tuple[Any, Any, RunConfig, dict]:
    """Base weights + the ledger at `path` (verified, audits judged): the run's model."""
    from seedflood_p2p.algorithm.basis import load_schedule
    from seedflood_p2p.algorithm.replay import replay
    from seedflood_p2p.apps.local import counted_updates
    from seedflood_p2p.network.transport.identity import verify_pubsub_signature
    from seedflood_p2p.storage.digests import digest_of
    from seedflood_p2p.storage.ledger import Ledger

    ledger = Ledger.open_existing(path)
    try:
        config = ledger.config
        ledger.verify(
            verify_pubsub_signature,
            "export a copy from a peer whose ledger checks out",
            directions=config.directions,
        )
        model, tokenizer = _base_model(config, base)
        messages, judgement = counted_updates(ledger, config)
        replay(model, config, messages, schedule=load_schedule(ledger))
        facts = {
            "source": f"replay of ledger {path.name}",
            "ledger_digest": digest_of(ledger.messages()),
            "messages": len(ledger),
            "rounds": ledger.max_round() + 1 if len(ledger) else 0,
            "peers": len({m.peer for m in messages}),
            "banned": len(judgement.banned),
        }
    finally:
        ledger.close()
    return model, tokenizer, config, facts


def rebuild_from_checkpoint(directory: Path, base: Path | None) -> tuple[Any, Any, RunConfig, dict]:
    """The weights of the checkpoint in a peer's data dir, on the base model."""
    from seedflood_p2p.algorithm.live import LiveModel
    from seedflood_p2p.algorithm.subcge import make_estimator
    from seedflood_p2p.storage.checkpoint import (
        read_checkpoint_meta,
        read_checkpoint_weights,
        tensors_sha256,
    )
    from seedflood_p2p.storage.ledger import Ledger

    try:
        meta = read_checkpoint_meta(directory)
    except FileNotFoundError:
        raise UserError(
            f"{directory} holds no checkpoint.json: pass a peer's data dir (--data-dir) that "
            "has written a checkpoint, or export from its ledger with --ledger"
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the checkpoint in {directory}: {exc}") from None
    with Ledger.open_existing(directory / "ledger.sqlite") as ledger:
        config = ledger.config
    model, tokenizer = _base_model(config, base)
    try:
        weights = read_checkpoint_weights(directory, "cpu")
    except Exception as exc:  # safetensors raises its own types for a damaged file
        raise UserError(f"cannot read the checkpoint weights in {directory}: {exc}") from None
    if tensors_sha256(weights) != meta.get("weights_sha256"):
        raise UserError(
            f"the checkpoint weights in {directory} do not hash as its checkpoint.json "
            "records (damaged or edited): export from the ledger with --ledger instead"
        )
    engine = make_estimator(model, config)
    try:
        LiveModel(engine).load_weights(weights)
    except (KeyError, ValueError) as exc:
        raise UserError(
            f"the checkpoint in {directory} does not fit the run's model ({exc})"
        ) from None
    finally:
        engine.close()
    facts = {
        "source": f"checkpoint of round {meta.get('round')} in {directory.name}",
        "ledger_digest": meta.get("ledger_digest", ""),
        "messages": meta.get("ledger_messages", 0),
        "rounds": int(meta.get("round", -1)) + 1,
    }
    return model, tokenizer, config, facts


def model_card(config: RunConfig, facts: dict, metrics: dict[str, float] | None) -> str:
    """README.md of an exported model."""
    from seedflood_p2p.workload.tasks import task_spec

    spec, label_column = task_spec(config)
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [seedflood, zeroth-order, peer-to-peer]",
        "---",
        "",
        f"# {config.model} fine-tuned by a SeedFlood run",
        "",
        "Trained peer to peer with zeroth-order updates (SeedFlood, SubCGE): these weights",
        "are the base model plus every update in the run's ledger, rebuilt bit for bit by",
        "`seedflood replay`.",
        "",
        "| | |",
        "|---|---|",
        f"| run id | `{config.run_id}` |",
        f"| ledger digest | `{facts.get('ledger_digest', '')}` |",
        f"| rounds | {facts.get('rounds', 0)} |",
        f"| update messages | {facts.get('messages', 0)} |",
        f"| exported from | {facts.get('source', '')} |",
        f"| base model | `{config.model}` (weights SHA-256 `{config.base_sha256 or '-'}`) |",
        f"| dataset | `{config.dataset}` (examples SHA-256 `{config.dataset_sha256 or '-'}`) |",
        f"| task | {spec.kind or 'from the data'}; template `{json.dumps(spec.template)}` |",
        f"| weights SHA-256 | `{facts.get('model_sha256', '')}` |",
    ]
    if spec.kind in ("", "classification"):
        words = ", ".join(json.dumps(w) for w in spec.label_words)
        lines.append(f"| label words | {words} (column `{label_column}`) |")
    if config.calibration:
        lines.append(f"| calibration | {config.calibration} (below) |")
    lines += ["", "## Held-out figures", ""]
    if metrics is None:
        lines.append(f"Not computed: {facts.get('eval_skipped', 'no data')}")
    else:
        lines.append(f"On {facts.get('eval_examples')} held-out examples of the run's split:")
        lines.append("")
        lines += [f"- {name}: {value:.4f}" for name, value in metrics.items()]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        "```",
        "",
        "The run's settings are in `seedflood_run.json` (its SHA-256 is the run id).",
        "",
    ]
    if config.calibration:
        lines += [
            "The run was trained, and the figures above scored, with content-free calibration:",
            "read a prompt's label-word logits minus those of the same template with every",
            'field "N/A". The raw logits alone carry a label prior the run did not train away.',
            "",
        ]
    return "\n".join(lines)
