# one H100: Qwen3-8B LoRA r64 colocated (issue 34 asks for one H100)
source gpu_session/env.sh
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv
t0=$(date +%s)
timeout 560 python3 bench/rl_gpu.py loop --shape qwen3-8b --placement colocate --lora-rank 64 --recompute full --micro-batch-tokens 8192 --steps 3 --json $OUT/lora8b_h100.jsonl > $OUT/lora8b_h100.log 2>&1; echo "lora8b rc=$? at $(( $(date +%s) - t0 )) s"
cut -c1-1200 $OUT/lora8b_h100.jsonl
grep -i "checkpoint\|error\|memory" $OUT/lora8b_h100.log | tail -8 | cut -c1-300
