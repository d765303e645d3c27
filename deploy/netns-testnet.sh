#!/usr/bin/env bash
# A testnet of several "hosts" on one Linux machine, built from network namespaces.
#
#   netns-testnet.sh [options] up        create the hosts and the switch
#   netns-testnet.sh [options] down      delete them (idempotent; --kill also stops processes)
#   netns-testnet.sh [options] exec HOST CMD...   run CMD inside HOST (h1, 1 or the full name)
#   netns-testnet.sh [options] status    hosts, addresses, qdiscs, processes
#   netns-testnet.sh [options] check     what this kernel supports (netns, veth, bridge, netem)
#   netns-testnet.sh [options] addr HOST print HOST's IPv4 address
#
# Layout (PREFIX defaults to "sfnet", SUBNET to 10.77.0):
#
#   PREFIX-h1 (eth0 SUBNET.1/24) --veth--+
#   PREFIX-h2 (eth0 SUBNET.2/24) --veth--+-- br0 in namespace PREFIX-sw
#   ...                                  |
#   PREFIX-hN (eth0 SUBNET.N/24) --veth--+
#
# Every interface lives in a namespace this script creates: nothing is added to the
# machine's own (root) namespace, the hosts have no default route, and the subnet exists
# only on the private bridge, so testnet traffic cannot leave it. Each host has its own
# loopback, so 127.0.0.1 services (metrics endpoints) are per host.
#
# Link emulation (applied to each host's eth0 egress, i.e. once per direction, so a
# round trip between two hosts sees 2x --delay):
#   --delay 20ms  --jitter 5ms  --loss 1%   need the kernel's netem qdisc (sch_netem).
#   --rate 10mbit                           uses tbf.
# If netem is missing (kernel built without CONFIG_NET_SCH_NETEM, or the module cannot be
# loaded), --loss is applied by nftables instead (`nft`: a rule drops that share of the
# packets arriving on each host's eth0 at random, numgen random), and `up` says what it
# cannot apply (delay, jitter) and builds the testnet without it.
# --require-netem turns a missing delay or jitter into an error instead.
#
# Needs root, iproute2 (`ip`, `tc`: apt-get install -y iproute2) and a kernel with
# network namespaces, veth and bridge support.
set -euo pipefail

PREFIX="${SEEDFLOOD_NETNS_PREFIX:-sfnet}"
SUBNET="10.77.0"
HOSTS=3
DELAY=""
JITTER=""
LOSS=""
RATE=""
REQUIRE_NETEM=0
KILL=0

usage() {
    sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
    cat <<EOF

Options:
  --hosts N          number of hosts (1..200, default $HOSTS)
  --prefix NAME      namespace name prefix (default $PREFIX; env SEEDFLOOD_NETNS_PREFIX)
  --subnet A.B.C     first three octets of the /24 (default $SUBNET)
  --delay D          netem one-way delay per host egress, e.g. 20ms
  --jitter J         netem delay variation, e.g. 5ms (with --delay)
  --loss P           loss per host egress, e.g. 1% (netem; without it, nftables)
  --rate R           tbf rate limit per host egress, e.g. 10mbit
  --require-netem    fail if --delay/--loss/--jitter cannot be applied
  --kill             (down) stop processes still running in the namespaces, by PID
EOF
}

die() { echo "netns-testnet: error: $*" >&2; exit 1; }
say() { echo "netns-testnet: $*" >&2; }

# -- arguments -----------------------------------------------------------------------------
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --hosts) HOSTS="${2:?}"; shift 2 ;;
        --prefix) PREFIX="${2:?}"; shift 2 ;;
        --subnet) SUBNET="${2:?}"; shift 2 ;;
        --delay) DELAY="${2:?}"; shift 2 ;;
        --jitter) JITTER="${2:?}"; shift 2 ;;
        --loss) LOSS="${2:?}"; shift 2 ;;
        --rate) RATE="${2:?}"; shift 2 ;;
        --require-netem) REQUIRE_NETEM=1; shift ;;
        --kill) KILL=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; ARGS+=("$@"); break ;;
        -*)
            # options after the subcommand of `exec` belong to CMD
            if [[ ${#ARGS[@]} -gt 0 && "${ARGS[0]}" == exec ]]; then ARGS+=("$@"); break; fi
            die "unknown option $1 (see --help)" ;;
        *)
            ARGS+=("$1"); shift
            # everything after `exec HOST` is the command, options included
            if [[ ${#ARGS[@]} -eq 2 && "${ARGS[0]}" == exec ]]; then ARGS+=("$@"); break; fi
            ;;
    esac
done
[[ ${#ARGS[@]} -ge 1 ]] || { usage; exit 2; }
CMD="${ARGS[0]}"

[[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9_-]{0,19}$ ]] || die "--prefix must be 1-20 of [A-Za-z0-9_-]"
[[ "$HOSTS" =~ ^[0-9]+$ && "$HOSTS" -ge 1 && "$HOSTS" -le 200 ]] || die "--hosts must be 1..200"
[[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "--subnet must look like 10.77.0"
SW="$PREFIX-sw"

host_ns() {  # h3 | 3 | PREFIX-h3 -> PREFIX-h3
    local h="$1"
    case "$h" in
        "$PREFIX"-h*) echo "$h" ;;
        h[0-9]*) echo "$PREFIX-$h" ;;
        [0-9]*) echo "$PREFIX-h$h" ;;
        *) die "unknown host '$h': use h1..hN, 1..N or $PREFIX-hN" ;;
    esac
}

our_namespaces() {  # all namespaces of this testnet, hosts first
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(h[0-9]+|sw|probe)$" \
        | sort -V || true
}

need_tools() {
    command -v ip >/dev/null || die "'ip' not found: install iproute2 (apt-get install -y iproute2)"
    if [[ "$EUID" -ne 0 ]]; then die "must run as root (network namespaces need CAP_SYS_ADMIN)"; fi
}

# -- capability probe ------------------------------------------------------------------------
# Sets HAVE_NETNS, HAVE_VETH, HAVE_BRIDGE, HAVE_TC, HAVE_NETEM, HAVE_TBF (1/0) and NETEM_WHY.
probe() {
    HAVE_NETNS=0 HAVE_VETH=0 HAVE_BRIDGE=0 HAVE_TC=0 HAVE_NETEM=0 HAVE_TBF=0 HAVE_NFT=0 NETEM_WHY=""
    local p="$PREFIX-probe" q="$PREFIX-probe2"
    ip netns del "$p" 2>/dev/null || true
    ip netns del "$q" 2>/dev/null || true
    ip netns add "$p" 2>/dev/null || return 0
    HAVE_NETNS=1
    if ip netns add "$q" 2>/dev/null \
        && ip link add name vprobe0 netns "$p" type veth peer name vprobe1 netns "$q" 2>/dev/null; then
        HAVE_VETH=1
        ip -n "$p" link set vprobe0 up 2>/dev/null || true
    fi
    ip -n "$p" link add br0 type bridge 2>/dev/null && HAVE_BRIDGE=1
    if command -v tc >/dev/null; then
        HAVE_TC=1
        if [[ $HAVE_VETH == 1 ]]; then
            local err
            if err=$(ip netns exec "$p" tc qdisc add dev vprobe0 root netem delay 1ms 2>&1); then
                HAVE_NETEM=1
            else
                err="${err//$'\n'/ }"
                local config=""
                [[ -r /proc/config.gz ]] && config=$(zcat /proc/config.gz 2>/dev/null || true)
                if grep -q '^# CONFIG_NET_SCH_NETEM is not set' <<<"$config"; then
                    NETEM_WHY="kernel $(uname -r) is built without CONFIG_NET_SCH_NETEM; tc said: $err"
                elif [[ ! -d /lib/modules/$(uname -r) ]]; then
                    NETEM_WHY="sch_netem is not loaded and /lib/modules/$(uname -r) is missing; tc said: $err"
                else
                    NETEM_WHY="sch_netem is not loaded (try 'modprobe sch_netem'); tc said: $err"
                fi
            fi
            ip netns exec "$p" tc qdisc del dev vprobe0 root 2>/dev/null || true
            ip netns exec "$p" tc qdisc add dev vprobe0 root tbf rate 10mbit burst 32kbit latency 400ms \
                2>/dev/null && HAVE_TBF=1
        fi
    else
        NETEM_WHY="'tc' not found: install iproute2"
    fi
    if command -v nft >/dev/null && nft_loss "$p" 1 2>/dev/null; then HAVE_NFT=1; fi
    ip netns del "$p" 2>/dev/null || true
    ip netns del "$q" 2>/dev/null || true
}

# nft_loss NS PERCENT: drop PERCENT (0-100, to 2 decimals) of the packets arriving on NS's
# eth0, at random. Each packet between two hosts meets it once, as it meets one egress
# netem; dropped on arrival, it is lost as on a wire (a drop on the output hook would
# instead fail the sender's send with EPERM, which TCP and UDP see).
nft_loss() {
    local per10k
    per10k=$(awk -v p="${2%\%}" 'BEGIN { if (p !~ /^[0-9]+(\.[0-9]+)?$/ || p > 100) exit 1; printf "%d", p * 100 + 0.5 }') \
        || { echo "--loss '$2' is not a percentage from 0 to 100" >&2; return 1; }
    ip netns exec "$1" nft -f - <<EOF
table inet sfloss {
    chain arrive {
        type filter hook prerouting priority -300; policy accept;
        iifname "eth0" numgen random mod 10000 < $per10k drop
    }
}
EOF
}

yn() { [[ "$1" == 1 ]] && echo yes || echo no; }

cmd_check() {
    need_tools
    probe
    echo "netns: $(yn $HAVE_NETNS)"
    echo "veth: $(yn $HAVE_VETH)"
    echo "bridge: $(yn $HAVE_BRIDGE)"
    echo "tc: $(yn $HAVE_TC)"
    echo "netem: $(yn $HAVE_NETEM)${NETEM_WHY:+ ($NETEM_WHY)}"
    echo "tbf: $(yn $HAVE_TBF)"
    echo "nft loss: $(yn $HAVE_NFT)"
    [[ $HAVE_NETNS == 1 && $HAVE_VETH == 1 && $HAVE_BRIDGE == 1 ]]
}

# -- up / down ---------------------------------------------------------------------------------
cmd_up() {
    need_tools
    if [[ -n "$(our_namespaces)" ]]; then
        die "a testnet with prefix '$PREFIX' exists ($(our_namespaces | tr '\n' ' ')); run 'down' first"
    fi
    [[ -z "$JITTER" || -n "$DELAY" ]] || die "--jitter needs --delay"
    probe
    [[ $HAVE_NETNS == 1 ]] || die "cannot create network namespaces (need root and CONFIG_NET_NS)"
    [[ $HAVE_VETH == 1 ]] || die "cannot create veth pairs (kernel without CONFIG_VETH?)"
    [[ $HAVE_BRIDGE == 1 ]] || die "cannot create a bridge (kernel without CONFIG_BRIDGE?)"
    local netem_args=()
    [[ -n "$DELAY" ]] && netem_args+=(delay "$DELAY" ${JITTER:+"$JITTER"})
    [[ -n "$LOSS" ]] && netem_args+=(loss "$LOSS")
    local use_netem=0 nft_loss_pct=""
    if [[ ${#netem_args[@]} -gt 0 ]]; then
        if [[ $HAVE_NETEM == 1 ]]; then
            use_netem=1
        elif [[ -z "$DELAY" && $HAVE_NFT == 1 ]]; then
            nft_loss_pct="$LOSS"
            say "netem is not available ($NETEM_WHY): --loss $LOSS is applied by nftables"
        elif [[ $REQUIRE_NETEM == 1 ]]; then
            die "netem is not available: $NETEM_WHY"
        elif [[ -n "$LOSS" && $HAVE_NFT == 1 ]]; then
            nft_loss_pct="$LOSS"
            say "WARNING: netem is NOT available, so --delay/--jitter are IGNORED:"
            say "WARNING:   $NETEM_WHY"
            say "WARNING: --loss $LOSS is applied by nftables; the testnet has no delay."
        else
            say "WARNING: netem is NOT available, so --delay/--jitter/--loss are IGNORED:"
            say "WARNING:   $NETEM_WHY"
            say "WARNING: the testnet is built without delay or loss."
        fi
    fi
    if [[ -n "$RATE" && $HAVE_TBF != 1 ]]; then
        [[ $REQUIRE_NETEM == 1 ]] && die "tbf is not available for --rate"
        say "WARNING: tbf is not available: --rate is IGNORED"
        RATE=""
    fi

    arp_table_fits
    trap 'say "up failed: removing what was built"; REMOVED=(); cmd_down_quiet || true' ERR
    ip netns add "$SW"
    ip -n "$SW" link set lo up
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    local i ns
    for ((i = 1; i <= HOSTS; i++)); do
        ns="$PREFIX-h$i"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add name eth0 netns "$ns" type veth peer name "h$i" netns "$SW"
        ip -n "$SW" link set "h$i" master br0
        ip -n "$SW" link set "h$i" up
        ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ $use_netem == 1 && -n "$RATE" ]]; then
            ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: netem "${netem_args[@]}"
            ip netns exec "$ns" tc qdisc add dev eth0 parent 1: handle 2: \
                tbf rate "$RATE" burst 32kbit latency 400ms
        elif [[ $use_netem == 1 ]]; then
            ip netns exec "$ns" tc qdisc add dev eth0 root netem "${netem_args[@]}"
        elif [[ -n "$RATE" ]]; then
            ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 32kbit latency 400ms
        fi
        if [[ -n "$nft_loss_pct" ]]; then nft_loss "$ns" "$nft_loss_pct"; fi
    done
    trap - ERR
    local shaping="none"
    if [[ $use_netem == 1 ]]; then shaping="netem ${netem_args[*]}"; fi
    if [[ -n "$nft_loss_pct" ]]; then shaping="nftables loss $nft_loss_pct"; fi
    if [[ -n "$RATE" ]]; then shaping="${shaping/none/} tbf rate $RATE"; fi
    say "up: $HOSTS hosts $PREFIX-h1..h$HOSTS on $SUBNET.1-$HOSTS/24 (bridge in $SW); shaping per host egress: ${shaping# }"
    for ((i = 1; i <= HOSTS; i++)); do echo "h$i $PREFIX-h$i $SUBNET.$i"; done
}

# The kernel's ARP table is one for all namespaces, and its hard limit (gc_thresh3, 1024 by
# default) counts every host's entries: HOSTS hosts that all talk to each other hold about
# HOSTS^2. Past it, resolutions fail at random ("neighbor table overflow" in dmesg) and
# some pairs of hosts cannot reach each other at all (measured: 20 of 63 from one host at
# 64 hosts). So `up` raises the limits to fit, never lowers them, and says so.
arp_table_fits() {
    local need=$((2 * HOSTS * HOSTS + 1024)) key now
    now=$(sysctl -n net.ipv4.neigh.default.gc_thresh3 2>/dev/null || echo 0)
    ((now >= need)) && return 0
    for key in gc_thresh1:$((need / 4)) gc_thresh2:$((need / 2)) gc_thresh3:$need; do
        sysctl -qw "net.ipv4.neigh.default.${key%%:*}=${key#*:}" \
            || die "cannot raise net.ipv4.neigh.default.${key%%:*} for $HOSTS hosts"
    done
    say "raised the machine's ARP table limit (net.ipv4.neigh.default.gc_thresh3) from $now to $need: $HOSTS hosts hold up to $HOSTS^2 entries"
}

ns_pids() { ip netns pids "$1" 2>/dev/null | tr '\n' ' ' || true; }

cmd_down_quiet() {  # returns 1 if a namespace had to be kept
    local ns pids all="" kept=0
    if [[ $KILL == 1 ]]; then
        # SIGTERM everything first (peers finish a round and checkpoint, which takes a few
        # seconds), wait up to 30 s for all of it, then SIGKILL what is left.
        for ns in $(our_namespaces); do
            pids=$(ns_pids "$ns")
            [[ -n "${pids// /}" ]] || continue
            say "stopping processes in $ns: ${pids% }"
            all+=" $pids"
        done
        if [[ -n "${all// /}" ]]; then
            # shellcheck disable=SC2086
            kill -TERM $all 2>/dev/null || true
            for _ in $(seq 60); do
                all=$(for p in $all; do kill -0 "$p" 2>/dev/null && echo "$p"; done | tr '\n' ' ')
                [[ -n "${all// /}" ]] || break
                sleep 0.5
            done
            if [[ -n "${all// /}" ]]; then
                say "killing processes that ignored SIGTERM: $all"
                # shellcheck disable=SC2086
                kill -KILL $all 2>/dev/null || true
                sleep 0.5
            fi
        fi
    fi
    for ns in $(our_namespaces); do
        pids=$(ns_pids "$ns")
        if [[ -n "${pids// /}" ]]; then
            # Deleting the name would leave the namespace (and its veth) alive but unreachable.
            say "WARNING: kept $ns: processes still run in it (pids: ${pids% }); stop them" \
                "or use 'down --kill'"
            kept=1
            continue
        fi
        ip netns del "$ns" 2>/dev/null || true
        REMOVED+=("$ns")
    done
    return $kept
}

cmd_down() {
    need_tools
    REMOVED=()
    local rc=0
    cmd_down_quiet || rc=1
    if [[ ${#REMOVED[@]} -gt 0 ]]; then
        say "down: removed ${REMOVED[*]}"
    elif [[ $rc == 0 ]]; then
        say "down: nothing to remove"
    fi
    return $rc
}

cmd_exec() {
    need_tools
    [[ ${#ARGS[@]} -ge 3 ]] || die "usage: exec HOST CMD [ARGS...]"
    local ns
    ns=$(host_ns "${ARGS[1]}")
    ip netns list | awk '{print $1}' | grep -qx "$ns" || die "host $ns does not exist (run 'up')"
    # exec: the command keeps this shell's PID, so callers can stop it by PID
    exec ip netns exec "$ns" "${ARGS[@]:2}"
}

cmd_addr() {
    [[ ${#ARGS[@]} -ge 2 ]] || die "usage: addr HOST"
    local ns
    ns=$(host_ns "${ARGS[1]}")
    ip -n "$ns" -4 -o addr show dev eth0 | awk '{split($4, a, "/"); print a[1]}'
}

cmd_status() {
    need_tools
    local ns
    if [[ -z "$(our_namespaces)" ]]; then echo "no testnet with prefix '$PREFIX'"; return 0; fi
    for ns in $(our_namespaces); do
        [[ "$ns" == "$SW" ]] && continue
        echo "$ns: $(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}')" \
            " qdisc: $(ip netns exec "$ns" tc qdisc show dev eth0 2>/dev/null | head -1)" \
            "$(ip netns exec "$ns" nft list table inet sfloss 2>/dev/null | grep -o 'numgen.*drop' | sed 's/^/ nft: /')" \
            " pids: $(ip netns pids "$ns" | tr '\n' ' ')"
    done
    echo "$SW: bridge br0 with $(ip -n "$SW" -o link show master br0 | wc -l) ports"
}

case "$CMD" in
    up) cmd_up ;;
    down) cmd_down ;;
    exec) cmd_exec ;;
    addr) cmd_addr ;;
    status) cmd_status ;;
    check) cmd_check ;;
    *) die "unknown command '$CMD' (up, down, exec, addr, status, check)" ;;
esac
