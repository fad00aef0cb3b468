#!/usr/bin/env bash
# A PostgreSQL server on loopback for the sweeper's shared-storage test (tests/sweep/test_sweep.py):
# installs Debian's package when it is missing, starts the newest cluster, makes a role and a
# database, and prints the SQLAlchemy URL. Run as root.
set -euo pipefail

setup() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq postgresql >/dev/null
  fi
  ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
  pg_lsclusters -h | awk '{print $1, $2}' | grep -qx "$ver main" || pg_createcluster "$ver" main >/dev/null
  pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main" {print $4}' | grep -qx online || pg_ctlcluster "$ver" main start
  port=$(pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main" {print $3}')
  cd /tmp
  su postgres -c "psql -p $port -tAc \"SELECT 1 FROM pg_roles WHERE rolname = 'sweeper'\"" | grep -q 1 ||
    su postgres -c "psql -p $port -qc \"CREATE ROLE sweeper LOGIN PASSWORD 'sweeper'\""
  su postgres -c "psql -p $port -tAc \"SELECT 1 FROM pg_database WHERE datname = 'sweeps'\"" | grep -q 1 ||
    su postgres -c "createdb -p $port -O sweeper sweeps"
}

# Only the URL goes to stdout (the caller captures it): what the tools print goes to stderr
# (pg_ctlcluster, for one, prints "Removed stale pid file." on start). No extra descriptor is
# opened, so the server started here holds nothing the caller's $(...) waits on.
setup >&2
echo "postgresql://sweeper:sweeper@127.0.0.1:$port/sweeps"
