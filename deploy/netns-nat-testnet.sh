#!/usr/bin/env bash
# A testnet with NAT: public hosts on a bridge, and private hosts each behind its own NAT
# router (nftables masquerade), built from network namespaces on one Linux machine.
#
#   netns-nat-testnet.sh [options] up       create it
#   netns-nat-testnet.sh [options] down     delete it (idempotent; --kill stops processes by PID)
#   netns-nat-testnet.sh [options] exec HOST CMD...   run CMD inside HOST (pub1, priv1, nat1, ...)
#   netns-nat-testnet.sh [options] check    can this machine build it (netns, veth, bridge, nft)
#
# Layout (PREFIX defaults to "sfnat", PUBLIC to 11.78.0):
#
#   PREFIX-pub1 (PUBLIC.1) --+
#   PREFIX-pub2 (PUBLIC.2) --+-- br0 in PREFIX-sw ("the internet")
#   PREFIX-nat1 (PUBLIC.101) -+      PREFIX-nat1: lan0 192.168.1.1/24, masquerades lan -> eth0
#        |                              (forwarding on; no port forwarding, so nothing from
#   PREFIX-priv1 (192.168.1.2)          outside reaches priv1 unless priv1 opened it)
#   ... one nat/priv pair per --private host
#
# The public side uses addresses outside the private ranges on purpose: libp2p treats
# 10/8, 172.16/12 and 192.168/16 as private, so AutoNAT servers would not dial them back
# and auto-relay would not announce a relay that has only such addresses. The namespaces
# have no route to the machine's own network, so nothing is ever sent to the real 11.78.0.x.
#
# Public hosts have no route to any 192.168.x.0/24, so a private host can only be reached
# through a connection it opened itself (or a relay it holds a reservation on). Every
# interface lives in a namespace this script creates; nothing touches the root namespace.
#
# Needs root, iproute2 and nftables (`apt-get install -y nftables`).
set -euo pipefail

PREFIX="${SEEDFLOOD_NAT_PREFIX:-sfnat}"
PUBLIC="11.78.0"
PUBLIC_HOSTS=2
PRIVATE_HOSTS=2
KILL=0

die() { echo "netns-nat-testnet: error: $*" >&2; exit 1; }
say() { echo "netns-nat-testnet: $*" >&2; }

ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="${2:?}"; shift 2 ;;
        --public-subnet) PUBLIC="${2:?}"; shift 2 ;;
        --public) PUBLIC_HOSTS="${2:?}"; shift 2 ;;
        --private) PRIVATE_HOSTS="${2:?}"; shift 2 ;;
        --kill) KILL=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *)
            ARGS+=("$1"); shift
            if [[ ${#ARGS[@]} -eq 2 && "${ARGS[0]}" == exec ]]; then ARGS+=("$@"); break; fi
            ;;
    esac
done
[[ ${#ARGS[@]} -ge 1 ]] || die "usage: $0 [--prefix P] [--public N] [--private N] up|down|exec|check"
[[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,14}$ ]] || die "--prefix must be 1-15 of [A-Za-z0-9_-]"
[[ "$PUBLIC_HOSTS" =~ ^[0-9]+$ && "$PUBLIC_HOSTS" -ge 1 && "$PUBLIC_HOSTS" -le 50 ]] \
    || die "--public must be 1..50"
[[ "$PRIVATE_HOSTS" =~ ^[0-9]+$ && "$PRIVATE_HOSTS" -le 50 ]] || die "--private must be 0..50"
SW="$PREFIX-sw"

our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' \
        | grep -E "^${PREFIX}-(pub[0-9]+|priv[0-9]+|nat[0-9]+|sw|probe)$" | sort -V || true
}

need_tools() {
    command -v ip >/dev/null || die "'ip' not found: install iproute2"
    [[ "$EUID" -eq 0 ]] || die "must run as root (network namespaces need CAP_SYS_ADMIN)"
}

cmd_check() {
    need_tools
    local p="$PREFIX-probe" ok=0
    ip netns del "$p" 2>/dev/null || true
    if ip netns add "$p" 2>/dev/null; then
        echo "netns: yes"
        if ip -n "$p" link add v0 type veth peer name v1 2>/dev/null; then echo "veth: yes"; else echo "veth: no"; ok=1; fi
        if ip -n "$p" link add br0 type bridge 2>/dev/null; then echo "bridge: yes"; else echo "bridge: no"; ok=1; fi
        if ! command -v nft >/dev/null; then
            echo "nft: no (apt-get install -y nftables)"; ok=1
        elif ip netns exec "$p" nft add table ip probe 2>/dev/null; then
            echo "nft: yes"
        else
            echo "nft: no (nft cannot create a table: kernel without nf_tables?)"; ok=1
        fi
        ip netns del "$p"
    else
        echo "netns: no"; ok=1
    fi
    return $ok
}

cmd_up() {
    need_tools
    command -v nft >/dev/null || die "'nft' not found: apt-get install -y nftables"
    [[ -z "$(our_namespaces)" ]] || die "a testnet with prefix '$PREFIX' exists; run 'down' first"
    trap 'say "up failed: removing what was built"; KILL=0 cmd_down || true' ERR
    ip netns add "$SW"
    ip -n "$SW" link set lo up
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    local i ns port=0
    attach() {  # attach NS's eth0 to the public bridge with address $2
        port=$((port + 1))
        ip link add name eth0 netns "$1" type veth peer name "p$port" netns "$SW"
        ip -n "$SW" link set "p$port" master br0
        ip -n "$SW" link set "p$port" up
        ip -n "$1" addr add "$2/24" dev eth0
        ip -n "$1" link set eth0 up
    }
    for ((i = 1; i <= PUBLIC_HOSTS; i++)); do
        ns="$PREFIX-pub$i"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        attach "$ns" "$PUBLIC.$i"
    done
    for ((i = 1; i <= PRIVATE_HOSTS; i++)); do
        local nat="$PREFIX-nat$i" priv="$PREFIX-priv$i"
        ip netns add "$nat"
        ip netns add "$priv"
        ip -n "$nat" link set lo up
        ip -n "$priv" link set lo up
        attach "$nat" "$PUBLIC.$((100 + i))"
        ip link add name lan0 netns "$nat" type veth peer name eth0 netns "$priv"
        ip -n "$nat" addr add "192.168.$i.1/24" dev lan0
        ip -n "$nat" link set lan0 up
        ip -n "$priv" addr add "192.168.$i.2/24" dev eth0
        ip -n "$priv" link set eth0 up
        ip -n "$priv" route add default via "192.168.$i.1"
        ip netns exec "$nat" sysctl -qw net.ipv4.ip_forward=1
        # A home router: rewrite outgoing connections to the router's public address;
        # replies come back through conntrack; nothing unsolicited gets in, and an
        # unsolicited packet to the router itself is dropped silently (as home routers do),
        # not answered with a TCP reset, which would abort a hole punch's simultaneous open.
        ip netns exec "$nat" nft -f - <<EOF
table ip nat {
    chain postrouting { type nat hook postrouting priority srcnat; oifname "eth0" masquerade; }
}
table ip filter {
    chain forward {
        type filter hook forward priority filter; policy drop;
        iifname "lan0" oifname "eth0" accept
        ct state established,related accept
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "eth0" ct state established,related accept
        iifname "eth0" drop
    }
}
EOF
    done
    trap - ERR
    say "up: public $PUBLIC.1-$PUBLIC_HOSTS (pub1..pub$PUBLIC_HOSTS); $PRIVATE_HOSTS private hosts" \
        "192.168.N.2 (privN) behind NAT routers $PUBLIC.10N (natN)"
}

cmd_down() {
    need_tools
    local ns pids all=""
    if [[ $KILL == 1 ]]; then
        for ns in $(our_namespaces); do all+=" $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"; done
        if [[ -n "${all// /}" ]]; then
            # shellcheck disable=SC2086
            kill -TERM $all 2>/dev/null || true
            for _ in $(seq 40); do
                all=$(for p in $all; do kill -0 "$p" 2>/dev/null && echo "$p"; done | tr '\n' ' ')
                [[ -n "${all// /}" ]] || break
                sleep 0.5
            done
            # shellcheck disable=SC2086
            [[ -z "${all// /}" ]] || kill -KILL $all 2>/dev/null || true
            sleep 0.3
        fi
    fi
    local kept=0
    for ns in $(our_namespaces); do
        if [[ -n "$(ip netns pids "$ns" 2>/dev/null)" ]]; then
            say "WARNING: kept $ns: processes still run in it; use 'down --kill'"
            kept=1
            continue
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    return $kept
}

cmd_exec() {
    need_tools
    [[ ${#ARGS[@]} -ge 3 ]] || die "usage: exec HOST CMD [ARGS...]"
    local ns="$PREFIX-${ARGS[1]}"
    ip netns list | awk '{print $1}' | grep -qx "$ns" || die "host $ns does not exist (run 'up')"
    exec ip netns exec "$ns" "${ARGS[@]:2}"  # keeps this PID: callers stop it by PID
}

case "${ARGS[0]}" in
    up) cmd_up ;;
    down) cmd_down ;;
    exec) cmd_exec ;;
    check) cmd_check ;;
    *) die "unknown command '${ARGS[0]}' (up, down, exec, check)" ;;
esac
