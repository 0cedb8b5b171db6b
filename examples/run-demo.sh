#!/bin/sh
# `agentd run` as a person meets it: one long task in the foreground on the scripted
# model, killed (kill -9) partway, then carried to completion with `agentd run --resume`.
# Every charge the task makes lands on a ledger exactly once. No daemon, no API key.
# Run it with `make demo-run` (or AGENTD=path/to/agentd sh examples/run-demo.sh).
set -eu
AGENTD=${AGENTD:-agentd}
demo=$(mktemp -d "${TMPDIR:-/tmp}/agentd-run-demo.XXXXXX")
trap 'rm -rf "$demo"' EXIT
export AGENTD_SPOOL="$demo/spool" AGENTD_CONFIG="$demo/agentd.toml"
: > "$AGENTD_CONFIG"  # the built-in defaults

# Six turns, each charging one invoice with append_file (an unsafe tool: run twice, it
# would charge twice), and the model taking a moment over each reply.
{
  printf '{"responses": [\n'
  for n in 1 2 3 4 5 6; do
    printf '  {"content": [{"type": "text", "text": "Charging invoice %s."},' "$n"
    printf ' {"type": "tool_use", "name": "append_file", "input": {"path": "ledger.txt",'
    printf ' "content": "invoice %s: charged 10 EUR\\n"}}], "delay": 0.8},\n' "$n"
  done
  printf '  {"content": [{"type": "text", "text": "All six invoices are charged."}]}\n]}\n'
} > "$demo/invoices.json"

echo "\$ agentd run --name invoices --script invoices.json --prompt 'Charge the six invoices.'"
"$AGENTD" run --name invoices --script "$demo/invoices.json" --prompt "Charge the six invoices." &
run=$!
# Partway: once three charges have their results recorded, the run is killed outright.
while [ "$("$AGENTD" show invoices --json 2>/dev/null | grep -c '"tool_result"')" -lt 3 ]; do
  sleep 0.1
done
kill -9 "$run"
wait "$run" 2>/dev/null || true
echo
echo "\$ kill -9 $run    # agentd run, and its worker with it"
echo "\$ agentd status invoices"
"$AGENTD" status invoices
echo
echo "\$ agentd run --resume invoices"
"$AGENTD" run --resume invoices
echo
echo "\$ cat ledger.txt"
ledger="$AGENTD_SPOOL/tasks/invoices/workspace/ledger.txt"
cat "$ledger"
if [ "$(wc -l < "$ledger")" -eq 6 ] && [ -z "$(sort "$ledger" | uniq -d)" ]; then
  echo "every invoice charged exactly once"
else
  echo "agentd run demo: the ledger is wrong" >&2
  exit 1
fi
