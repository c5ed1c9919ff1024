# NEXT SESSION (written at the end of the fourteenth, 2026-11-28). Kinds lent then: h200, -x2, -x4.
# Staging as lease23.sh (p1, then p2 + setup). Budget note: a 16-layer MoE folder is built on
# the GPU once (/tmp/moe, ~45 s) and each ep = 4 row took ~180 s at 8 layers (spawn, load,
# compile); give the 16-layer rows 400 s each (they timed out at 280 s before the conversion fix).
# 1. ep = 4 at equal parameters a GPU (16 layers), router and random logits:
#      timeout 400 python3 bench/moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 4 [--balanced-routing] --model-dir /tmp/moe
# 2. ep = 2's gap: the backward's exchanges under deferred weight-gradient GEMMs (not built yet).
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
ep4)
  for r in "" "--balanced-routing"; do
    n=${r:+bal}; n=${n:-router}
    timeout 400 python3 bench/moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 4 $r --model-dir /tmp/moe --json $OUT/ep4_16_$n.json > $OUT/ep4_16_$n.log 2>&1
    grep -h '^{"trainer' $OUT/ep4_16_$n.log | cut -c1-500; echo "$n at $(( $(date +%s) - t0 )) s"
  done
  ;;
esac
