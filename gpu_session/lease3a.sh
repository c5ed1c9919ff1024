# next lease, call A (two GPUs): colocated 1.7B loop then vLLM alone on GPU 0 (same GPU, one call:
# the <= 1.10x sum-of-parts target); Qwen3-8B LoRA r64 colocated loop on GPU 1 meanwhile
source gpu_session/env.sh
mkdir -p $OUT
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=1 timeout 560 python3 bench/rl_gpu.py loop --shape qwen3-8b --placement colocate --lora-rank 64 --recompute full --micro-batch-tokens 8192 --steps 3 --json $OUT/lora8b.jsonl > $OUT/lora8b.log 2>&1 &
L=$!
rm -rf /tmp/rl_gpu/runs/qwen3-1.7b-colocate*
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/rl_gpu.py loop --shape qwen3-1.7b --placement colocate --steps 3 --json $OUT/colocate.jsonl > $OUT/colocate.log 2>&1; echo "colocate rc=$? at $(( $(date +%s) - t0 )) s"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/rl_gpu.py generate --shape qwen3-1.7b --placement colocate --repeat 3 --json $OUT/generate.jsonl > $OUT/generate.log 2>&1; echo "generate rc=$?"
wait $L; echo "lora8b rc=$? at $(( $(date +%s) - t0 )) s"
cut -c1-900 $OUT/colocate.jsonl; cut -c1-400 $OUT/generate.jsonl; cut -c1-900 $OUT/lora8b.jsonl
grep -i "checkpoint\|error" $OUT/lora8b.log | tail -5 | cut -c1-300
