#!/usr/bin/env bash
# Distributed tuning on a GPU machine, in a few minutes. From the repository root:
#
#   . tools/device_prep.sh 'PATTERNS'   # on the lent GPU machine: wheels (psycopg too) and sparktune._C
#   tools/gpu_check_cluster.sh
#
#  1. A database server: a throwaway PostgreSQL cluster started here when its programs exist
#     (initdb and pg_ctl on PATH, in /usr/lib/postgresql/*/bin, or in $PG_BIN) and psycopg can
#     be imported; otherwise a SQLite file, said so (the same leases, one host only).
#  2. Two `sparktune tune --recipe` workers at once against it (on two GPUs when there are
#     two; sharing one GPU otherwise, which disturbs their timings but not the division of
#     work). Each problem must be tuned by exactly one worker and its records stored once.
#  3. Dispatch in a fresh process reads the database (and, for PostgreSQL, keeps a snapshot);
#     with the server stopped, a fresh process dispatches from the snapshot.
#  4. The database password (the URL has one) must appear in no output.
# Everything goes to $OUT (or a temporary directory); the exit status is 1 when a check fails.
# `tools/gpu_check_cluster.sh --dry-run` runs the same on a machine without a GPU, with the
# known-cost test backend of tests/plugin_pkg instead of real kernels (a check of the script).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "$dry" = 0 ] && ! "$PY" -c "import optuna, sqlalchemy, yaml" 2>/dev/null && [ -d .whl ]; then
  . tools/device_prep.sh "${SPARKTUNE_KERNELS:-}"
fi
if ! "$PY" -c "import psycopg" 2>/dev/null && ls .whl/psycopg*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/psycopg*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
work=$(mktemp -d)
chmod 755 "$work"
out=${OUT:-$work}
export SPARKTUNE_SHIPPED_DB=""
export SPARKTUNE_SNAPSHOT_DIR=$work/snapshots
unset SPARKTUNE_DB
SECRET=cluster-check-pw-5b1
now() { "$PY" -c 'import time; print(time.time())'; }
since() { "$PY" -c "import time; print(f'{time.time() - $1:.1f}')"; }

# ---------------------------------------------------------------- 1. the database
pgbin=${PG_BIN:-}
if [ -z "$pgbin" ]; then
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    pgbin=$(dirname "$(command -v initdb)")
  else
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
      if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then pgbin=$d; break; fi
    done
  fi
fi
pg_started=0
as_pg() { "$@"; }
stop_pg() {
  if [ "$pg_started" = 1 ]; then
    as_pg "$pgbin/pg_ctl" -D "$work/pg/data" -m fast -w stop >/dev/null 2>&1 || true
    pg_started=0
  fi
}
trap stop_pg EXIT
if [ -n "$pgbin" ] && [ -x "$pgbin/initdb" ] && [ -x "$pgbin/pg_ctl" ] && "$PY" -c "import psycopg" 2>/dev/null; then
  mkdir -p "$work/pg/data" "$work/pg/sock"
  if [ "$(id -u)" = 0 ]; then  # initdb refuses to run as root
    pguser=postgres
    id -u "$pguser" >/dev/null 2>&1 || pguser=nobody
    chown -R "$pguser" "$work/pg"
    as_pg() { runuser -u "$pguser" -- "$@"; }
  fi
  port=${PG_PORT:-55432}
  as_pg "$pgbin/initdb" -D "$work/pg/data" -U sparktune --auth=trust -E UTF8 >"$out/pg_initdb.log" 2>&1
  as_pg "$pgbin/pg_ctl" -D "$work/pg/data" -l "$work/pg/server.log" -w \
    -o "-p $port -k $work/pg/sock -c listen_addresses=127.0.0.1" start >/dev/null
  pg_started=1
  "$PY" - "$port" <<'PYEOF'
import sys, psycopg
with psycopg.connect(host="127.0.0.1", port=int(sys.argv[1]), user="sparktune", dbname="postgres", autocommit=True) as c:
    c.execute("CREATE DATABASE sparktune")
PYEOF
  db_url="postgresql+psycopg://sparktune:$SECRET@127.0.0.1:$port/sparktune"
  echo "database: PostgreSQL $("$pgbin/postgres" --version | awk '{print $NF}') started here on port $port (from $pgbin)"
else
  db_url="sqlite:///$work/cluster.sqlite3"
  why="no initdb/pg_ctl found"
  [ -n "$pgbin" ] && [ -x "$pgbin/initdb" ] && why="psycopg cannot be imported"
  echo "database: SQLite $work/cluster.sqlite3 -- no PostgreSQL here ($why); the same leases, one host"
fi

# ---------------------------------------------------------------- 2. two workers
cat >"$work/recipe.yaml" <<'YAMLEOF'
name: cluster-check
description: a small recipe for the distributed-tuning check
budget: {trials: 8}
shapes:
  - {seqlen: [1024, 4096], heads: 8, head_dim: [64, 128], ops: fwd}
  - {seqlen: 2048, heads: 8, head_dim: 128, causal: true, ops: [fwd, bwd]}
YAMLEOF
# the dry run: the command line's code, the known-cost backend and a cost timer, on the CPU
cat >"$work/dry_tune.py" <<'PYEOF'
import sys
sys.path.insert(0, "tests/plugin_pkg")
import sparktune_testplugin
from sparktune import registry
from sparktune.cli import build_parser
from sparktune.cli import tune as tune_cli
from sparktune.tune import CostTimer
from tests._store_helpers import DEVICE, known_cost

registry.register_backend(sparktune_testplugin.KnownCostBackend(), replace=True)
args = build_parser().parse_args(["tune", *sys.argv[1:]])
problems, extra = tune_cli.problems_from_args(args)
sys.exit(tune_cli.run(args, problems, extra, device=DEVICE, torch_device="cpu", timer=CostTimer(known_cost)))
PYEOF
if [ "$dry" = 1 ]; then
  cat >"$work/recipe.yaml" <<'YAMLEOF'
name: cluster-check-dry
budget: {trials: 8}
backends: [knowncost]
shapes:
  - {seqlen: [32, 64], heads: 2, head_dim: [16, 32], ops: fwd}
  - {seqlen: 48, heads: 2, head_dim: 16, causal: true, ops: [fwd, bwd]}
YAMLEOF
  echo "DRY RUN on the CPU: the known-cost test backend, no GPU kernels"
  ngpu=0
else
  ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  echo "GPUs: $ngpu; $([ "$ngpu" -ge 2 ] && echo 'one worker per GPU' || echo 'both workers share GPU 0 (timings disturbed)')"
  "$PY" -m sparktune info | head -12 || true
fi
t0=$(now)
pids=()
for i in 0 1; do
  gpu=$([ "$ngpu" -ge 2 ] && echo "$i" || echo 0)
  if [ "$dry" = 1 ]; then cmd=("$PY" "$work/dry_tune.py"); else cmd=("$PY" -m sparktune tune); fi
  CUDA_VISIBLE_DEVICES=$gpu timeout 420 "${cmd[@]}" --recipe "$work/recipe.yaml" --db "$db_url" \
    --lease 30 --json --no-progress >"$out/worker$i.json" 2>"$out/worker$i.err" &
  pids+=($!)
done
codes=()
for p in "${pids[@]}"; do
  if wait "$p"; then codes+=(0); else codes+=($?); fi
done
echo "workers finished in $(since "$t0") s, exit codes ${codes[*]}"
for i in 0 1; do sed "s/^/  worker$i: /" "$out/worker$i.err"; done

# ---------------------------------------------------------------- 3. results and dispatch
"$PY" -m sparktune db leases --db "$db_url" | tee "$out/leases.txt"
"$PY" -m sparktune db list --db "$db_url" | tee "$out/db_list.txt"
status=0
"$PY" - "$out" "$db_url" "${codes[@]}" <<'PYEOF' || status=1
import json, sys
from collections import Counter
from sparktune.db import Store, problem_key
from sparktune.tune import LeaseBoard

out, url, codes = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3:]]
ok = codes == [0, 0]
workers = [json.load(open(f"{out}/worker{i}.json")) for i in (0, 1)]
tuned = [[p["key"] for p in w["cluster"]["problems"] if p["state"] == "tuned"] for w in workers]
all_keys = {p["key"] for w in workers for p in w["cluster"]["problems"]}
print(f"tuned by worker 0: {len(tuned[0])}, by worker 1: {len(tuned[1])}, problems: {len(all_keys)}")
both = set(tuned[0]) & set(tuned[1])
if both or set(tuned[0]) | set(tuned[1]) != all_keys:
    ok = False
    print("MISS: problems tuned twice or not at all:", both or all_keys - set(tuned[0]) - set(tuned[1]))
with Store(url) as s:
    rows = LeaseBoard(s).rows()
    per = Counter((problem_key(r.problem), r.label) for r in s.records())
if not rows or not all(r.state == "done" and r.attempts == 1 for r in rows):
    ok = False
    print("MISS: leases not all done once:", [(r.label.split(" | ")[0], r.state, r.attempts) for r in rows])
if any(n != 1 for n in per.values()):
    ok = False
    print("MISS: records stored more than once:", [k for k, n in per.items() if n != 1])
for i, w in enumerate(workers):
    for r in w["results"]:
        b = r["best"] or {}
        print(f"  worker {i}: {r['key']}: {b.get('candidate')} {b.get('median_ms') or float('nan'):.4g} ms, "
              f"{b.get('tflops') or 0:.1f} TFLOP/s ({r['mode']}, {r['trials']} trials, {r['wall_s']:.1f} s)")
print("division of work:", "ok" if ok else "MISSED")
sys.exit(0 if ok else 1)
PYEOF

explain() {
  "$PY" - "$db_url" "$work/recipe.yaml" "$dry" <<'PYEOF'
import logging, sys
logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
import sparktune
from sparktune import dispatch
from sparktune.problem import DeviceInfo
from sparktune.tune import load_recipe
dispatch.configure(sys.argv[1])
if sys.argv[3] == "1":
    sys.path.insert(0, "tests/plugin_pkg")
    import sparktune_testplugin
    from sparktune import registry
    from tests._store_helpers import DEVICE as dev
    registry.register_backend(sparktune_testplugin.KnownCostBackend(), replace=True)
else:
    dev = DeviceInfo.from_torch("cuda")
sources = set()
for p in load_recipe(sys.argv[2]).problems:
    e = sparktune.explain(p, dev)
    print(f"  {p.op} n{p.seqlen_q} d{p.head_dim}{' causal' if p.causal else ''}: {e.selection.candidate.label} ({e.selection.source})")
    sources.update(e.sources)
print("  records from:", "; ".join(sorted(sources)))
PYEOF
}
echo "dispatch in a fresh process:"
explain 2>&1 | tee "$out/dispatch.txt"
grep -q "(tuned)" "$out/dispatch.txt" || { echo "MISS: dispatch used no tuned record"; status=1; }
if [ "$pg_started" = 1 ]; then
  ls "$SPARKTUNE_SNAPSHOT_DIR" 2>/dev/null | sed 's/^/  snapshot: /'
  stop_pg
  echo "dispatch in a fresh process with the server stopped:"
  t1=$(now)
  explain 2>&1 | tee "$out/dispatch_offline.txt"
  echo "  (took $(since "$t1") s including the imports)"
  if ! grep -q "using its local snapshot" "$out/dispatch_offline.txt" || ! grep -q "(tuned)" "$out/dispatch_offline.txt"; then
    echo "MISS: no dispatch from the snapshot"
    status=1
  fi
fi

# ---------------------------------------------------------------- 4. the password
if grep -rl "$SECRET" "$out" --include='*.txt' --include='*.json' --include='*.err' 2>/dev/null; then
  echo "MISS: the database password was printed (files above)"
  status=1
fi
echo
echo "outputs in $out"
if [ "$status" = 0 ]; then echo "cluster check: ok"; echo ok >"$out/targets_cluster.txt"; else
  echo "cluster check: MISSED"; echo missed >"$out/targets_cluster.txt"; fi
exit "$status"
