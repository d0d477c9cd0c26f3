#!/usr/bin/env bash
# The peer side of the latency floor: ejabberd 23.01 from Debian, one MUC room
# per sender count, archived by MAM in a throwaway PostgreSQL 15 cluster
# (fsync and synchronous_commit on), driven by `imcore-load peer-xmpp` over
# XMPP-over-WebSocket on loopback. Everything it starts runs under its own
# temporary directory on free loopback ports and is stopped on exit.
#
#   benches/peers/ejabberd/run.sh [--senders 1,8,64] [--seconds 8]
#       [--out evidence/bench/peers/ejabberd.json] [--load-bin target/release/imcore-load]
#
# Needs root (apt-get, runs PostgreSQL as `postgres` and ejabberd as `ejabberd`).
set -euo pipefail

SENDERS=1,8,64
SECONDS_PER_RUN=8
OUT=evidence/bench/peers/ejabberd.json
LOAD_BIN=target/release/imcore-load
while [ $# -gt 0 ]; do
    case $1 in
        --senders) SENDERS=$2; shift 2 ;;
        --seconds) SECONDS_PER_RUN=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --load-bin) LOAD_BIN=$2; shift 2 ;;
        *) echo "usage: $0 [--senders 1,8,64] [--seconds 8] [--out FILE] [--load-bin PATH]" >&2; exit 2 ;;
    esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
PGBIN=/usr/lib/postgresql/15/bin
[ -x "$LOAD_BIN" ] || { echo "no $LOAD_BIN: cargo build --release -p imcore-load" >&2; exit 2; }
[ -x "$PGBIN/initdb" ] || { echo "no PostgreSQL 15 in $PGBIN (apt-get install postgresql-15)" >&2; exit 2; }

# 1. ejabberd and its PostgreSQL driver, from Debian. The package enables a
#    system service on the default node; it must not run beside ours.
if ! dpkg -s ejabberd erlang-p1-pgsql >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ejabberd erlang-p1-pgsql
fi
if [ -d /run/systemd/system ]; then
    systemctl disable --now ejabberd.service >/dev/null 2>&1 || true
fi
EJ_VERSION=$(dpkg-query -W -f='${Version}' ejabberd)
SCHEMA=/usr/share/ejabberd/sql/pg.sql
[ -f "$SCHEMA" ] || SCHEMA=$(dpkg -L ejabberd | grep '/pg\.sql$' | head -n1)

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
WORK=$(mktemp -d /tmp/ejabberd-peer.XXXXXX)
chmod 755 "$WORK"
PGDATA=$WORK/pg/data
EJDIR=$WORK/ejabberd
PGPORT=$(free_port)
HTTPPORT=$(free_port)
DISTPORT=$(free_port)
PGPASSWORD=$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')
NODE=ejabberd-peer-$$@localhost
CTL=(/usr/sbin/ejabberdctl --config-dir "$EJDIR" --ctl-config "$EJDIR/ejabberdctl.cfg"
     --spool "$EJDIR/spool" --logs "$EJDIR/logs" --node "$NODE")

teardown() {
    set +e
    if [ -s "$EJDIR/ejabberd.pid" ]; then
        local pid; pid=$(cat "$EJDIR/ejabberd.pid")
        timeout 60 "${CTL[@]}" stop >/dev/null 2>&1
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    [ -f "$PGDATA/postmaster.pid" ] && runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
    rm -rf "$WORK"
}
trap teardown EXIT

# 2. A throwaway PostgreSQL 15 cluster, durable as imcore's: loopback TCP,
#    scram passwords, fsync and synchronous_commit on (stated, not assumed).
mkdir -p "$WORK/pg"
chown postgres: "$WORK/pg"
echo postgres >"$WORK/pg/pw"
chown postgres: "$WORK/pg/pw"
runuser -u postgres -- "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=scram-sha-256 -E UTF8 --no-locale \
    --pwfile="$WORK/pg/pw" >/dev/null
runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGDATA" -l "$WORK/pg/log" -w start -o \
    "-p $PGPORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$WORK/pg -c fsync=on -c synchronous_commit=on" \
    >/dev/null
PGMASTER=$(head -n1 "$PGDATA/postmaster.pid")
psql_as() { PGPASSWORD=$2 psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U "$1" -d "$3" "${@:4}"; }
psql_as postgres postgres postgres -c "CREATE ROLE ejabberd LOGIN PASSWORD '$PGPASSWORD'" -c "CREATE DATABASE ejabberd OWNER ejabberd"
psql_as ejabberd "$PGPASSWORD" ejabberd -f "$SCHEMA" >/dev/null
MAX_C=$(tr ',' '\n' <<<"$SENDERS" | sort -n | tail -n1)
# C accounts u1..uC (password pN), in ejabberd's own `users` table (auth_method: sql).
psql_as ejabberd "$PGPASSWORD" ejabberd \
    -c "INSERT INTO users (username, password) SELECT 'u' || g, 'p' || g FROM generate_series(1, $MAX_C) g"

# 3. Our own ejabberd node: own config, spool and logs, no epmd (a fixed
#    distribution port), listening on loopback only.
mkdir -p "$EJDIR/spool" "$EJDIR/logs"
cp /etc/ejabberd/inetrc "$EJDIR/inetrc"
sed -e "s/@PGPORT@/$PGPORT/" -e "s/@PGPASSWORD@/$PGPASSWORD/" -e "s/@HTTPPORT@/$HTTPPORT/" \
    "$HERE/ejabberd.yml.in" >"$EJDIR/ejabberd.yml"
cat >"$EJDIR/ejabberdctl.cfg" <<EOF
ERL_DIST_PORT=$DISTPORT
INET_DIST_INTERFACE=127.0.0.1
EJABBERD_PID_PATH=$EJDIR/ejabberd.pid
EJABBERD_BYPASS_WARNINGS=true
EOF
chown -R ejabberd: "$EJDIR"
chmod 600 "$EJDIR/ejabberd.yml"
"${CTL[@]}" start
"${CTL[@]}" started || { cat "$EJDIR/logs/"*.log >&2; exit 1; }
for _ in $(seq 1 30); do [ -s "$EJDIR/ejabberd.pid" ] && break; sleep 1; done
BEAM=$(cat "$EJDIR/ejabberd.pid")
echo "ejabberd $EJ_VERSION: node $NODE pid $BEAM, http 127.0.0.1:$HTTPPORT; PostgreSQL pid $PGMASTER port $PGPORT"

# 4. One members-only, persistent, archived room per sender count, its C
#    senders members of it (the ReST API of mod_muc_admin, loopback only).
api() {
    curl -sS --fail-with-body -H 'Content-Type: application/json' -d "$2" "http://127.0.0.1:$HTTPPORT/api/$1"
    echo
}
for c in ${SENDERS//,/ }; do
    api create_room_with_opts "{\"name\":\"bench$c\",\"service\":\"conference.localhost\",\"host\":\"localhost\",
        \"options\":[{\"name\":\"persistent\",\"value\":\"true\"},{\"name\":\"members_only\",\"value\":\"true\"},
                     {\"name\":\"mam\",\"value\":\"true\"}]}" >/dev/null
    for i in $(seq 1 "$c"); do
        api set_room_affiliation "{\"name\":\"bench$c\",\"service\":\"conference.localhost\",
            \"jid\":\"u$i@localhost\",\"affiliation\":\"member\"}" >/dev/null
    done
done

# 5. The load: C senders per room, one message in flight each; the generator
#    checks the room's archive rows against its acks (the URL in the
#    environment keeps the password out of the evidence's command line).
PEER_DATABASE_URL="postgres://ejabberd:$PGPASSWORD@127.0.0.1:$PGPORT/ejabberd" \
"$LOAD_BIN" peer-xmpp --ws-url "ws://127.0.0.1:$HTTPPORT/ws" --domain localhost --room-prefix bench \
    --senders "$SENDERS" --seconds "$SECONDS_PER_RUN" \
    --server-pid "$BEAM" --postgres-pid "$PGMASTER" --peer "ejabberd $EJ_VERSION" --out "$OUT"
