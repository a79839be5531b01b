# Runs the named steps in order, each to /tmp/res/NAME.log with its exit code in NAME.rc (under
# pipefail: a step that pipes its tests through tail reports their status, not tail's).
source benchmarks/gpu_lease/env.sh
mkdir -p /tmp/res
for step in "$@"; do
  echo "$step $(date +%s)" > /tmp/res/current
  start=$SECONDS
  bash -o pipefail "benchmarks/gpu_lease/steps/$step.sh" > "/tmp/res/$step.log" 2>&1
  echo "rc=$? seconds=$((SECONDS - start))" > "/tmp/res/$step.rc"
done
echo done > /tmp/res/current
