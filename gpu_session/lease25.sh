# Lease 25 (fourteenth session, nvidia-h200-x4). Staging as lease23.sh:
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease23.sh setup
# then: bash gpu_session/lease25.sh ep12 ; ep4 ; tp2   (one bench at a time)
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
row() { grep -h '^{"trainer' "$@" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print({k: r[k] for k in r if k not in ('profile', 'top', 'times')})"; }
case $1 in
ep12)  # one GPU (4 layers) and ep = 2 (8 layers), router rows and balanced-routing rows
  for r in "" "--balanced-routing"; do
    n=${r:+bal}; n=${n:-router}
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/moe_gpu.py --trainers mtprun $r --model-dir /tmp/moe --json $OUT/one_$n.json > $OUT/one_$n.log 2>&1
    CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 bench/moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 $r --model-dir /tmp/moe --json $OUT/ep2_$n.json > $OUT/ep2_$n.log 2>&1
    echo "$n at $(( $(date +%s) - t0 )) s"
  done
  row $OUT/one_*.log $OUT/ep2_*.log; grep -h -i "error\|Traceback" $OUT/*.log | head -5
  ;;
ep4)  # ep = 4 (16 layers), both routings
  for r in "" "--balanced-routing"; do
    n=${r:+bal}; n=${n:-router}
    timeout 280 python3 bench/moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 4 $r --model-dir /tmp/moe --json $OUT/ep4_$n.json > $OUT/ep4_$n.log 2>&1
    echo "$n at $(( $(date +%s) - t0 )) s"
  done
  row $OUT/ep4_*.log; grep -h -i "error\|Traceback" $OUT/ep4_*.log | head -5
  ;;
tp2)  # Qwen3-8B shape tp = 2 with the hashed AdamW rounding
  CUDA_VISIBLE_DEVICES=0,1 timeout 500 python3 bench/trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 6 --json $OUT/tp2.json > $OUT/tp2.log 2>&1
  grep "^| " $OUT/tp2.log | tail -4; grep -h -i "error\|Traceback" $OUT/tp2.log | head -3; echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
