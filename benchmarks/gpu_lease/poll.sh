# Waits up to $1 seconds for the queue to end, then prints each finished step's log not yet
# printed (its last TAILC characters, 3000) and the running step's tail; copies every log to $OUT,
# and the last 256 KB of each log in the steps' folders (--logs: the services' logs).
limit=${1:-500}; start=$SECONDS
# EXTRA="step ...": a second queue, started once the first is done (once a lease).
extra() {
  grep -q '^done' /tmp/res/current 2>/dev/null && [ -n "${EXTRA:-}" ] && [ ! -e /tmp/res/extra.started ] || return 1
  touch /tmp/res/extra.started; echo "extra starting" > /tmp/res/current
  (setsid bash benchmarks/gpu_lease/queue.sh $EXTRA </dev/null >/dev/null 2>&1 &)
}
while [ $((SECONDS - start)) -lt "$limit" ]; do
  extra
  grep -q '^done' /tmp/res/current 2>/dev/null && break
  sleep 10
done
for rc in /tmp/res/*.rc; do
  [ -e "$rc" ] || continue
  step=$(basename "$rc" .rc)
  [ -e "/tmp/res/$step.shown" ] && continue
  echo "===== $step: $(cat "$rc")"; tail -c "${TAILC:-3000}" "/tmp/res/$step.log"; touch "/tmp/res/$step.shown"
done
echo "===== current: $(cat /tmp/res/current 2>/dev/null) now $(date +%s)"
cur=$(cut -d' ' -f1 /tmp/res/current 2>/dev/null)
[ -n "$cur" ] && [ "$cur" != done ] && tail -c 1500 "/tmp/res/$cur.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
cp /tmp/res/*.log "$OUT/" 2>/dev/null
find /tmp/res -mindepth 2 -name '*.log' | while read -r log; do
  kept="$OUT/services/$(realpath --relative-to=/tmp/res "$log" | tr / _)"
  mkdir -p "$OUT/services" && tail -c 262144 "$log" > "$kept"
done; true
