# Lease 17 (nvidia-h100-x4 hoped H100): phase A/B/C, each one call after the 2 staging calls.
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
case $1 in
A)  # ep=2 profile on 0,1 | Qwen3-8B tp=2 on 2,3
  (cd bench && CUDA_VISIBLE_DEVICES=0,1 timeout 400 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8 --profile --top 25 > $OUT/ep2_prof.log 2>&1) &
  (cd bench && CUDA_VISIBLE_DEVICES=2,3 timeout 500 python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 3 --json $OUT/tp2.json > $OUT/tp2.log 2>&1) &
  wait; grep -h '^{"trainer\|^{"shape\|mfu' $OUT/ep2_prof.log $OUT/tp2.log | cut -c1-260; grep -h '^{"gpu_busy' $OUT/ep2_prof.log | cut -c1-1500
  grep -h -i "Traceback\|Error" $OUT/*.log | head -5 ;;
B)  # ep=2 with DDP overlap (probe) on 0,1 | MoE one GPU mtprun,hf on 2 | 1.5B sft,grpo on 3 | adamw test after
  (cd bench && CUDA_VISIBLE_DEVICES=0,1 MTPRUN_PROBE_OVERLAP=${OV:-1} PYTHONPATH=$PWD/../gpu_session/probe_site:$PYTHONPATH timeout 400 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8 > $OUT/ep2_overlap.log 2>&1; CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8 > $OUT/ep2_plain.log 2>&1) &
  (cd bench && CUDA_VISIBLE_DEVICES=2 timeout 400 python3 moe_gpu.py --trainers mtprun,hf --model-dir /tmp/moe > $OUT/moe1.log 2>&1) &
  (cd bench && CUDA_VISIBLE_DEVICES=3 timeout 300 python3 trainer_gpu.py --workload sft,grpo --trainers mtprun --seq 4096 > $OUT/dense15.log 2>&1; cd .. && CUDA_VISIBLE_DEVICES=3 timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_triton_adamw_gpu.py > $OUT/t.log 2>&1) &
  wait; grep -h '^{"trainer' $OUT/*.log | cut -c1-260; tail -1 $OUT/t.log; grep -h -i "Traceback\|Error" $OUT/*.log | head -5 ;;
esac
echo "at $(( $(date +%s) - t0 )) s"
case $1 in
C)  # alone, one after another: tp=2 sft+grpo profiled (0,1), then one-GPU MoE mtprun,hf (0)
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 timeout 330 python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 3 --profile $OUT/prof > $OUT/tp2.log 2>&1
  grep -h '^{"trainer' $OUT/tp2.log | cut -c1-330; echo "tp2 at $(( $(date +%s) - t0 )) s"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 moe_gpu.py --trainers mtprun,hf --model-dir /tmp/moe > $OUT/moe1.log 2>&1
  grep -h '^{"trainer' $OUT/moe1.log | cut -c1-260 ;;
esac
