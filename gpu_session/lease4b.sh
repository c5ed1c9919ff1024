# same H100: colocated 1.7B loop then vLLM alone (the <= 1.10x sum-of-parts target, second card)
source gpu_session/env.sh
mkdir -p $OUT
rm -rf /tmp/rl_gpu/runs/qwen3-1.7b-colocate*
timeout 330 python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement colocate --steps 3 --json $OUT/colocate_h100.jsonl > $OUT/colocate_h100.log 2>&1; echo "colocate rc=$?"
timeout 200 python3 bench/rl_gpu.py generate --shape qwen3-1.7b --placement colocate --repeat 3 --json $OUT/generate_h100.jsonl > $OUT/generate_h100.log 2>&1; echo "generate rc=$?"
cut -c1-900 $OUT/colocate_h100.jsonl; cut -c1-400 $OUT/generate_h100.jsonl
grep -i "checkpoint" $OUT/colocate_h100.log | tail -3 | cut -c1-300
