# Lease 18 (nvidia-h100-x2): the Triton RMSNorm. old = HEAD 5a4f00c's mtprun (gpu_session/old)
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
OLD="PYTHONPATH=/tmp/site:$PWD/gpu_session/old:$PWD/bench"
case $1 in
A)
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_rms_norm.py tests/kernels/test_swiglu.py > $OUT/t.log 2>&1; tail -1 $OUT/t.log
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 timeout 330 python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 3 --model-dir /tmp/m8 > $OUT/tp2.log 2>&1
  grep -h '^{"trainer' $OUT/tp2.log | cut -c1-300; echo "tp2 at $(( $(date +%s) - t0 )) s"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 trainer_gpu.py --workload sft,grpo --trainers mtprun --seq 4096 --model-dir /tmp/m15 > $OUT/d15.log 2>&1
  CUDA_VISIBLE_DEVICES=0 env $OLD timeout 150 python3 trainer_gpu.py --workload sft,grpo --trainers mtprun --seq 4096 --model-dir /tmp/m15 > $OUT/d15_old.log 2>&1
  grep -h '^{"trainer' $OUT/d15*.log | cut -c1-250; echo "at $(( $(date +%s) - t0 )) s" ;;
B)
  cd bench
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 moe_gpu.py --trainers mtprun,hf --model-dir /tmp/moe > $OUT/moe.log 2>&1
  CUDA_VISIBLE_DEVICES=0 env $OLD timeout 120 python3 moe_gpu.py --trainers mtprun --model-dir /tmp/moe > $OUT/moe_old.log 2>&1
  grep -h '^{"trainer' $OUT/moe*.log | cut -c1-250
  CUDA_DEVICE_MAX_CONNECTIONS=1 CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 3 --model-dir /tmp/m8 > $OUT/tp2_cdmc1.log 2>&1
  grep -h '^{"trainer' $OUT/tp2_cdmc1.log | cut -c1-300; echo "at $(( $(date +%s) - t0 )) s" ;;
esac
