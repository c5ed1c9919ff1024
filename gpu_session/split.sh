# mtprun split + async (trainer GPU 0, engine GPU 1), then TRL server mode on the same two GPUs
source gpu_session/env.sh
mkdir -p $OUT
timeout ${T1:-300} python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement split --staleness 1 --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/mtprun_split.log 2>&1; echo "mtprun split rc=$?"
tail -25 $OUT/mtprun_split.log
timeout ${T2:-270} python3 bench/trl_grpo_gpu.py --server --model /tmp/rl_gpu/models/2048x28-w --steps ${STEPS:-4} --json $OUT/results.jsonl > $OUT/trl_server.log 2>&1; echo "trl server rc=$?"
tail -25 $OUT/trl_server.log
cat $OUT/results.jsonl
