# NEXT SESSION (written at the end of the thirteenth, 2026-11-28). Kinds lent then: h200, -x2, -x4.
# Staging as lease23.sh (p1, then p2 + setup; fla part only for Qwen3.5 rows).
# 1. ep = 2 and one GPU with --balanced-routing (the exchange without the random router's
#    uneven load, run 93: busiest rank 1.107x the mean on average): x2 kind, sequentially:
#      CUDA_VISIBLE_DEVICES=0 python3 bench/moe_gpu.py --trainers mtprun --balanced-routing --model-dir /tmp/moe
#      python3 bench/moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --balanced-routing --model-dir /tmp/moe
#    and the router rows again beside them (run 93: 239.9 ms, one GPU 140.7 ms).
# 2. ep = 4 on the x4 kind (0.76x last measured, run 12-era; target 0.88x): --layers 16 --ep 4, both routings.
# 3. Qwen3-8B tp = 2 with the hashed AdamW rounding (bf16 moments; ~11 ms of optimizer a step less expected).
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
ep2)
  cd bench
  for r in "" "--balanced-routing"; do
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 moe_gpu.py --trainers mtprun $r --model-dir /tmp/moe --json $OUT/b$r.json > $OUT/b$r.log 2>&1
    timeout 300 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 $r --model-dir /tmp/moe --json $OUT/c$r.json > $OUT/c$r.log 2>&1
  done
  grep -h '^{"trainer' $OUT/*.log | cut -c1-400; echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
