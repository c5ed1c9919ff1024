# call A: GPU tests (all but split) on GPU 0, then vLLM alone; Qwen3-8B LoRA colocated loop on GPU 1
source gpu_session/env.sh
mkdir -p $OUT
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=1 timeout ${TL:-540} python3 bench/rl_gpu.py loop --shape qwen3-8b --placement colocate --lora-rank 64 --steps 3 --json $OUT/lora8b.jsonl > $OUT/lora8b.log 2>&1 &
L=$!
CUDA_VISIBLE_DEVICES=0 timeout ${TT:-420} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" tests/runner/test_optimizer_state_gpu.py tests/runner/test_rl_gpu.py -k "not split" > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"; tail -25 $OUT/gpu_tests.log
left=$(( ${TL:-540} - ($(date +%s) - t0) - 10 ))
if [ $left -gt 90 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $left python3 bench/rl_gpu.py generate --shape qwen3-1.7b --placement colocate --repeat 3 --json $OUT/generate.jsonl > $OUT/generate.log 2>&1; echo "generate rc=$?"; tail -3 $OUT/generate.log | cut -c1-600
fi
wait $L; echo "lora8b rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "^\s*$" $OUT/lora8b.log | grep -i "checkpoint\|error\|step \|Traceback" | tail -15 | cut -c1-300
cat $OUT/lora8b.jsonl 2>/dev/null | cut -c1-1500
