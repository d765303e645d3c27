"""`seedflood status HOST:PORT`: one screen of a running peer's state, read from its /status page.

Standard library only, so the command answers at once: no torch, no network stack.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from seedflood_p2p.core.errors import UserError


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="HOST:PORT of a peer's --metrics-port")
    parser.add_argument("--json", action="store_true")


def cmd_status(args: argparse.Namespace) -> int:
    url = args.address if "://" in args.address else f"http://{args.address}"
    url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/status") else "/status")
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            status = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UserError(
            f"cannot read a peer's status at {url} ({exc}): start the peer with "
            "--metrics-port PORT and pass HOST:PORT"
        ) from None
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"peer        {status.get('peer_id')}  ({status.get('role', 'peer')}, "
        f"seedflood {status.get('version', '?')}, up {status.get('uptime_s', '?')} s)",
        f"run         {status.get('run_id')}",
    ]
    if status.get("run"):
        lines.append(f"run-wide    {format_run_line(status['run'])}")
    lines += [
        f"state       {status.get('state', '?')}",
        f"round       {status.get('round')}",
        f"peers alive {status.get('peers_alive')}",
        f"ledger      {status.get('ledger_messages')} messages",
    ]
    accepted = status.get("accepted", {})
    lines.append("accepted    " + "  ".join(f"{k} {v}" for k, v in accepted.items()))
    dropped = {k: v for k, v in status.get("dropped", {}).items() if v}
    lines.append("dropped     " + ("  ".join(f"{k} {v}" for k, v in dropped.items()) or "none"))
    banned = status.get("banned") or []
    lines.append(
        "banned      "
        + ("  ".join(f"..{b['peer'][-8:]} ({b['reason']})" for b in banned[:8]) or "none")
        + (f"  and {len(banned) - 8} more" if len(banned) > 8 else "")
    )
    audits = status.get("audits")
    if audits:  # a run with audits (manifest extra.audit)
        lines.append(
            f"audits      done {audits['done']}  mismatches {audits['mismatches']}  "
            f"published {audits['published']}  verdicts {audits['verdicts']}  "
            f"banned {'  '.join(audits['banned']) or 'none'}"
        )
        probation = audits.get("probation")
        if probation:  # a run with founders: new identities count once vouched
            lines.append(
                f"probation   we are {probation['we_are']}  established {probation['established']}"
                f" ({probation['founders']} founders)  on probation {probation['on_probation']}  "
                f"vouched updates {probation['vouched_updates']}  waiting "
                f"{probation['waiting_updates']}  backlog {probation['backlog']} update(s) of "
                f"{probation['backlog_peers']} peer(s) (budget {probation['share']} audits/round)"
            )
    if status.get("laggards"):
        lines.append(f"laggards    {status['laggards']} live peer(s) not waited for")
    if "bytes_out" in status:
        lines.append(f"bytes       out {status['bytes_out']}  in {status['bytes_in']}")
    if status.get("loss") is not None:
        lines.append(f"train loss  {status['loss']:.4f}")
    if status.get("eval"):
        loss, accuracy = status["eval"]
        lines.append(
            f"held-out    loss {loss:.4f}"
            + ("" if accuracy is None else f"  accuracy {accuracy:.3f}")
        )
    if status.get("peer_rounds"):
        lines.append(
            "peer rounds " + "  ".join(f"..{k}: {v}" for k, v in status["peer_rounds"].items())
        )
    network = status.get("network")
    if network:
        line = (
            f"network     {network.get('state', '?').upper()}: connected to "
            f"{network.get('connected_peers')} of {network.get('known_peers')} known peers"
        )
        if network.get("state") == "partitioned":
            unreachable = network.get("unreachable") or []
            diverged = network.get("diverged") or []
            line += f" for {network.get('for_s')} s"
            if unreachable:
                line += "; unreachable: " + ", ".join(f"..{p[-8:]}" for p in unreachable)
            if diverged:
                line += "; ledger differs from: " + ", ".join(f"..{p[-8:]}" for p in diverged)
        lines.append(line)
    lines += describe_join(status.get("checkpoint") or {})
    nat = status.get("nat")
    if nat:
        lines.append("reachable   " + describe_nat(nat))
    if status.get("model_sha256"):
        lines.append(f"model       sha256 {status['model_sha256']}")
    return "\n".join(lines)


def format_run_line(run: dict[str, Any]) -> str:
    """Round, peers and the latest held-out accuracy of the run, as this node sees it (the
    `run` field of /status, the same numbers as the head of /run.json)."""
    heldout = run.get("latest_heldout")
    if heldout and heldout.get("accuracy") is not None:
        score = f"held-out accuracy {heldout['accuracy']:.3f} (after {heldout['round']} rounds)"
    elif heldout:
        score = f"held-out loss {heldout['loss']:.4f} (after {heldout['round']} rounds)"
    else:
        score = "held-out accuracy n/a (no evaluations at this node)"
    return (
        f"round {run.get('round')}, {run.get('peers_alive')} peers alive of "
        f"{run.get('peers_known')} in the ledger, {score}"
    )


def describe_join(checkpoint: dict) -> list[str]:
    """A late joiner's fetched link: its history (when trusted) and its rebuild."""
    lines = []
    history = checkpoint.get("history")
    if history:
        head = f"history     trusted link of round {history['trusted_round']}: "
        if not history.get("checked"):
            held = history.get("held", history.get("held_at_ready", 0))
            lines.append(head + f"fetching, {held:,} of its {history['rows']:,} rows held")
        elif history.get("match"):
            lines.append(head + f"all {history['rows']:,} rows in, as it recorded")
        else:
            lines.append(head + "its rows DIFFER from what it recorded: model rebuilt")
    check = checkpoint.get("link_check")
    if check:
        head = f"link        fetched link of round {check['round']} rebuilt from its rows: "
        if check.get("match"):
            lines.append(head + "the same tensors")
        else:
            by = ", ".join(f"..{p[-8:]}" for p in check.get("offered_by") or []) or "?"
            lines.append(head + f"FORGED weights (offered by {by}): model rebuilt")
    return lines


def describe_nat(nat: dict) -> str:
    """One line: how others reach this node, its links by kind, hole punches seen."""
    how = {
        "direct": "directly at " + ", ".join(nat.get("public_addrs") or []),
        "relay": "only through relay " + ", ".join(f"..{r[-8:]}" for r in nat.get("relays", [])),
        "unknown": "not from outside (private addresses only, no relay reservation yet)",
    }.get(nat.get("reachable", ""), "?")
    line = (
        f"{how}; links: {nat.get('direct_peers', 0)} direct, {nat.get('relayed_peers', 0)} relayed"
    )
    via = nat.get("relayed_via") or {}
    if via:
        line += " (" + ", ".join(f"..{p[-8:]} via ..{r[-8:]}" for p, r in via.items()) + ")"
    punches = nat.get("hole_punches", 0)
    line += f"; hole punches: {punches} succeeded" if punches else "; hole punches: none yet"
    served = nat.get("relay_service")
    if served:
        line += (
            f"; relay for others: {served['bytes_relayed']} bytes, "
            f"{served['reservations_opened'] - served['reservations_closed']} reservations, "
            f"{served['circuits_opened'] - served['circuits_closed']} open circuits"
        )
    return line
