# split + async diag: trainer GPU 0, engine GPU 1; transfer timeout cut to ${TT:-90} s in this copy;
# nvidia-smi every 10 s; native py-spy of every python proc at ${DUMP:-150} s; then a retry with NCCL_P2P_DISABLE=1 if it failed
source gpu_session/env.sh
mkdir -p $OUT
sed -i "s/_TIMEOUT = timedelta(minutes=10)/_TIMEOUT = timedelta(seconds=${TT:-90})/" mtprun/runner/weight_transfer.py
grep -n "^_TIMEOUT" mtprun/runner/weight_transfer.py
export NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,COLL}
attempt() {  # $1 tag
  ( for i in $(seq 1 40); do date +%T; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader; sleep 10; done > $OUT/smi_$1.txt 2>&1 ) &
  M=$!
  timeout ${T1:-260} python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement split --staleness ${K:-1} --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/split_$1.log 2>&1 &
  A=$!
  ( sleep ${DUMP:-150}; for p in $(pgrep -f "python|ray::" ); do echo "=== $p $(tr '\0' ' ' < /proc/$p/cmdline | head -c 150)"; timeout 25 py-spy dump --native --pid $p 2>&1 | grep -v "^ *$" | head -45; done > $OUT/stacks_$1.txt 2>&1 ) &
  wait $A; rc=$?; kill $M 2>/dev/null; echo "split $1 rc=$rc"
  grep -v "NCCL INFO" $OUT/split_$1.log | tail -30 | cut -c1-250
  grep -c "NCCL INFO" $OUT/split_$1.log
  pkill -9 -f "ray::" ; ray stop --force >/dev/null 2>&1; sleep 2
  return $rc
}
attempt p2p || NCCL_P2P_DISABLE=1 attempt nop2p
cat $OUT/results.jsonl 2>/dev/null
