# shellcheck shell=bash disable=SC2034
# Shared by the load harness's measuring scripts (benches/load/scenarios and
# benches/load/memory); sourced, never run. The sourcing script sets `repo` (the
# repository root), `set -euo pipefail` and runs under scripts/mariadb, which exports
# BLOOMGATE_TEST_MYSQL_URL (no database in the path) and stops MariaDB afterwards.
#
# Provides: say/die; the database (db_user, db_pass, db_host, db_port, db_name, db_url,
# sql, com_select, seed_products); the processes the script starts (start_cleanup,
# pids, tmp), stopped by PID on exit; free_port and wait_http; BLOOMGATE, the release
# binary (under $CARGO_TARGET_DIR when that is set, or $LOAD_BLOOMGATE). (SC2034: the variables it sets are
# for the sourcing script.)

PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
# LOAD_BLOOMGATE measures another build (e.g. an older commit's, built in a worktree).
BLOOMGATE="${LOAD_BLOOMGATE:-${CARGO_TARGET_DIR:-$repo/target}/release/bloomgate}"

say() { echo "load: $*" >&2; }
die() {
    say "$*"
    exit 1
}

# ---- the database ------------------------------------------------------------------
: "${BLOOMGATE_TEST_MYSQL_URL:?run this through scripts/mariadb (benches/load/run does)}"
[[ "$BLOOMGATE_TEST_MYSQL_URL" =~ ^mysql://([^:]+):([^@]+)@([^:/]+):([0-9]+)/?$ ]] ||
    die "cannot parse BLOOMGATE_TEST_MYSQL_URL"
db_user="${BASH_REMATCH[1]}"
db_pass="${BASH_REMATCH[2]}"
db_host="${BASH_REMATCH[3]}"
db_port="${BASH_REMATCH[4]}"
db_name="bloomgate_load"
db_url="$BLOOMGATE_TEST_MYSQL_URL/$db_name"

sql() {
    MYSQL_PWD="$db_pass" mariadb --no-defaults -h "$db_host" -P "$db_port" -u "$db_user" -N -B "$@"
}
com_select() { sql -e "SHOW GLOBAL STATUS LIKE 'Com_select'" | awk '{print $2}'; }

# The SQL that fills the table: product i (0 <= i < N) has key 4i + 1 + (i mod 3), so
# the other three slots of each block of four are keys that never exist.
seed_sql() {
    echo "INSERT INTO products (sku_id, name, price, updated_at) SELECT seq * 4 + 1 + (seq % 3), CONCAT('Product ', seq), 1.00 + (seq % 99900) / 100, NOW() FROM seq_0_to_$(($1 - 1))"
}

# seed_products N: creates $db_name with the products table and N products (MariaDB's
# SEQUENCE engine); sets seed_secs and mariadb_version.
seed_products() {
    local n=$1 started=$SECONDS rows
    say "creating $db_name and loading $n products"
    sql -e "CREATE DATABASE $db_name"
    sql "$db_name" <"$repo/migrations/20261202000000_products.sql"
    sql "$db_name" -e "$(seed_sql "$n")"
    rows="$(sql "$db_name" -e 'SELECT COUNT(*) FROM products')"
    [[ "$rows" == "$n" ]] || die "expected $n rows, found $rows"
    seed_secs=$((SECONDS - started))
    say "loaded $rows products in ${seed_secs}s"
    mariadb_version="$(sql -e 'SELECT VERSION()')"
}

# ---- processes we start, stopped by PID on exit -----------------------------------
tmp=""
pids=()
cleanup() {
    local status=$?
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "process $pid did not stop within 10 s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    if [[ -n "$tmp" ]]; then
        rm -rf -- "$tmp"
    fi
    exit "$status"
}
# start_cleanup: makes the temp dir $tmp and arms the traps that stop every PID in
# $pids and remove $tmp on exit.
start_cleanup() {
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/bloomgate-load.XXXXXXXX")"
    trap cleanup EXIT
    trap 'say "command failed at line $LINENO: $BASH_COMMAND"' ERR
    trap 'exit 129' HUP
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

port_in_use() { (: >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# Ports are picked from 20000 up to the start of the kernel's ephemeral range: a port in
# that range can be the local end of an outgoing connection (to MariaDB, say), which the
# connect probe above cannot see but which makes a server's bind fail.
ephemeral_lo="$(awk '{print $1}' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true)"
if [[ "$ephemeral_lo" =~ ^[0-9]+$ ]] && ((ephemeral_lo > 21000)); then
    port_span=$((ephemeral_lo - 20000))
else
    port_span=40000
fi
# free_port: prints a port nobody listens on and no earlier call handed out (the ones
# handed out are kept in a file: callers run it in a subshell, "$(free_port)").
free_port() {
    local p
    while :; do
        p=$((20000 + (RANDOM * 32768 + RANDOM) % port_span))
        grep -qx "$p" "$tmp/ports" 2>/dev/null && continue
        port_in_use "$p" && continue
        echo "$p" >>"$tmp/ports"
        echo "$p"
        return
    done
}

# wait_http URL SECONDS PID: until URL answers 200 (or the process dies).
wait_http() {
    local url=$1 limit=$2 pid=$3 deadline=$((SECONDS + $2))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || die "process $pid exited while waiting for $url"
        if [[ "$(curl -s -o /dev/null -w '%{http_code}' "$url" || true)" == 200 ]]; then
            return 0
        fi
        sleep 0.2
    done
    die "$url did not answer 200 within ${limit}s"
}
