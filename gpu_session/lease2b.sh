# call B: the split GPU test, then the split loop (its final checkpoint timed)
source gpu_session/env.sh
mkdir -p $OUT
t0=$(date +%s)
timeout ${TT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" tests/runner/test_rl_gpu.py -k split > $OUT/gpu_split_test.log 2>&1
echo "split test rc=$? at $(( $(date +%s) - t0 )) s"; tail -15 $OUT/gpu_split_test.log
pkill -9 -f "ray::" ; ray stop --force >/dev/null 2>&1
rm -rf /tmp/rl_gpu/runs
left=$(( 585 - ($(date +%s) - t0) ))
timeout $left python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement split --staleness 1 --steps ${STEPS:-4} --json $OUT/split.jsonl > $OUT/split.log 2>&1; echo "split loop rc=$? at $(( $(date +%s) - t0 )) s"
grep -i "checkpoint\|error\|Traceback\|finished" $OUT/split.log | tail -8 | cut -c1-300
cat $OUT/split.jsonl 2>/dev/null | cut -c1-1500
