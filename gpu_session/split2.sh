# mtprun split + async (trainer GPU 0, engine GPU 1); stacks of every python process dumped at ${DUMP:-200} s
source gpu_session/env.sh
mkdir -p $OUT
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
timeout ${T1:-300} python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement split --staleness ${K:-1} --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/mtprun_split.log 2>&1 &
A=$!
( sleep ${DUMP:-200}; for p in $(pgrep -f "python|ray::" ); do echo "=== $p $(tr '\0' ' ' < /proc/$p/cmdline | head -c 200)"; timeout 20 py-spy dump --pid $p 2>&1 | head -60; done > $OUT/stacks.txt 2>&1 ) &
wait $A; echo "mtprun split rc=$?"
tail -25 $OUT/mtprun_split.log
grep -i "nccl" $OUT/mtprun_split.log | head -20
ls /tmp/rl_gpu/runs/*/ 2>/dev/null | head
