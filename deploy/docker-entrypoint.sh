#!/bin/sh
# Entrypoint of the SeedFlood-P2P image.
#
#   bootstrap [FLAGS]   seedflood bootstrap FLAGS
#   peer [FLAGS]        seedflood peer FLAGS; if SEEDFLOOD_BOOTSTRAP_FILE is set, first wait
#                       (up to SEEDFLOOD_BOOTSTRAP_WAIT seconds, default 300) for that file --
#                       a bootstrap node's address.txt on a shared volume -- and pass every
#                       non-loopback address in it with --bootstrap
#   train|eval|replay|demo|status|--help ...   other seedflood subcommands
#   anything else       run as a command (e.g. `sh`)
#
# SEEDFLOOD_LOG_FORMAT (text|json, default text) sets --log-format.
set -eu

fmt="${SEEDFLOOD_LOG_FORMAT:-text}"
[ "$#" -eq 0 ] && set -- --help

case "$1" in
    peer)
        shift
        file="${SEEDFLOOD_BOOTSTRAP_FILE:-}"
        if [ -n "$file" ]; then
            wait="${SEEDFLOOD_BOOTSTRAP_WAIT:-300}"
            waited=0
            until [ -s "$file" ] && grep -q '/p2p/' "$file"; do
                if [ "$waited" -ge "$wait" ]; then
                    echo "seedflood-entrypoint: no bootstrap address in $file after ${wait}s;" \
                        "is the bootstrap node running and sharing its data dir?" >&2
                    exit 2
                fi
                [ "$waited" -eq 0 ] && echo "seedflood-entrypoint: waiting for $file" >&2
                sleep 1
                waited=$((waited + 1))
            done
            # Every address of the bootstrap node except loopback ones (those would point
            # at this container itself).
            for addr in $(grep '/p2p/' "$file" | grep -v -e '^/ip4/127\.' -e '^/ip6/::1/'); do
                set -- --bootstrap "$addr" "$@"
            done
            echo "seedflood-entrypoint: bootstrap address(es) from $file:" \
                "$(grep '/p2p/' "$file" | grep -v -e '^/ip4/127\.' -e '^/ip6/::1/' | tr '\n' ' ')" >&2
        fi
        exec seedflood --log-format "$fmt" peer "$@"
        ;;
    bootstrap)
        shift
        exec seedflood --log-format "$fmt" bootstrap "$@"
        ;;
    train|eval|replay|demo|status|-*)
        exec seedflood "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
