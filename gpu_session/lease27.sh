# Fifteenth session (2026-11-28): the halves on two streams (HalfBatchStreams) against the tree
# before them (gpu_session/base = 5a6e09f's mtprun, first on PYTHONPATH), four H200s.
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease23.sh setup
# call 3: bash gpu_session/lease27.sh test ; call 4: ep2 ; call 5: ep4
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
BASE="env PYTHONPATH=/tmp/site:$PWD/gpu_session/base:$PWD"
row() {  # name, prefix, args...
  local n=$1 pre=$2; shift 2
  $pre timeout 330 python3 bench/moe_gpu.py "$@" --model-dir /tmp/moe --json $OUT/$n.json > $OUT/$n.log 2>&1
  grep -h '^{"trainer' $OUT/$n.log | cut -c1-600; grep -h -i "error\|Traceback" $OUT/$n.log | head -3
  echo "$n at $(( $(date +%s) - t0 )) s"
}
case $1 in
test)
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_half_batches_gpu.py > $OUT/t_halves.log 2>&1; tail -15 $OUT/t_halves.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
ep2)
  export CUDA_VISIBLE_DEVICES=0,1
  row ep2_halves "" --layers 8 --ep 2 --warmup 1 --steps 4
  row ep2_base "$BASE" --layers 8 --ep 2 --warmup 1 --steps 4
  ;;
ep2b)
  export CUDA_VISIBLE_DEVICES=0,1
  row ep2_halves_bal "" --layers 8 --ep 2 --warmup 1 --steps 4 --balanced-routing
  ;;
ep4)
  row ep4_16_halves "" --layers 16 --ep 4 --warmup 1 --steps 4
  ;;
ep4base)
  timeout 330 env PYTHONPATH=/tmp/site:$PWD/gpu_session/base:$PWD python3 bench/moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 4 --model-dir /tmp/moe --json $OUT/ep4_16_base.json > $OUT/ep4_16_base.log 2>&1
  grep -h '^{"trainer' $OUT/ep4_16_base.log | cut -c1-600; grep -h -i "error\|Traceback" $OUT/ep4_16_base.log | head -3; echo "ep4 at $(( $(date +%s) - t0 )) s"
  ;;
prof)
  export CUDA_VISIBLE_DEVICES=0,1
  row ep2_halves_prof "" --layers 8 --ep 2 --warmup 1 --steps 3 --profile
  ;;
esac
case $1 in
nccl)
  export CUDA_VISIBLE_DEVICES=0,1 NCCL_MAX_NCHANNELS=${2:-4}
  row ep2_halves_ch$2 "" --layers 8 --ep 2 --warmup 1 --steps 4
  row ep2_base_ch$2 "$BASE" --layers 8 --ep 2 --warmup 1 --steps 4
  ;;
ep4bal)
  timeout 330 env PYTHONPATH=/tmp/site:$PWD/gpu_session/base:$PWD python3 bench/moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 4 --balanced-routing --model-dir /tmp/moe --json $OUT/ep4_16_base_bal.json > $OUT/ep4_16_base_bal.log 2>&1
  grep -h '^{"trainer' $OUT/ep4_16_base_bal.log | cut -c1-600; echo "ep4bal at $(( $(date +%s) - t0 )) s"
  ;;
esac
