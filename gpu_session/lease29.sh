# NEXT SESSION (written in the sixteenth, 2026-11-29): `git apply gpu_session/overlap_param_gather.patch`
# first (not landed: needs two GPUs), re-stage .carry (p1 ray+megatron+pydantic+ruamel 52 MB, p2 the rest;
# OUT_DIR=.carry_t ../shared/gpu/stage.sh ray==2.52.1 megatron-core==0.16.1 'pydantic>=2.7,<3' 'ruamel.yaml>=0.18'
# then cat + split -b 52M into .carry/p1, .carry/p2), refresh gpu_session/base from the tree before the patch.
# Lease 29 (sixteenth session): megatron-core's overlapped parameter gather (blocks' pre-hooks)
# against the tree before it (gpu_session/base = 1d19ccf's mtprun, first on PYTHONPATH).
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease23.sh setup
# x2: call 3 test ; call 4 ep2 ; call 5 one.   one H200: one1 (tests + rows)
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
BASE="env PYTHONPATH=/tmp/site:$PWD/gpu_session/base:$PWD"
row() {  # name, prefix, args...
  local n=$1 pre=$2; shift 2
  $pre timeout 330 python3 bench/moe_gpu.py "$@" --model-dir /tmp/moe --json $OUT/$n.json > $OUT/$n.log 2>&1
  grep -h '^{"trainer' $OUT/$n.log | cut -c1-500; grep -h -i "error\|Traceback" $OUT/$n.log | head -3
  echo "$n at $(( $(date +%s) - t0 )) s"
}
case $1 in
test)
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_data_parallel_gpu.py > $OUT/t.log 2>&1; tail -15 $OUT/t.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
ep2)
  export CUDA_VISIBLE_DEVICES=0,1
  row ep2_new "" --layers 8 --ep 2 --warmup 1 --steps 4
  row ep2_base "$BASE" --layers 8 --ep 2 --warmup 1 --steps 4
  row ep2_new2 "" --layers 8 --ep 2 --warmup 1 --steps 4
  ;;
one)
  export CUDA_VISIBLE_DEVICES=0
  row one_new "" --trainers mtprun --warmup 1 --steps 4
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_main_grads_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_clip_in_step_gpu.py tests/kernels/test_triton_gpu.py -k "main_grad or optimizer or clip" > $OUT/t1.log 2>&1; tail -4 $OUT/t1.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
one1)
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_main_grads_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_clip_in_step_gpu.py tests/kernels/test_triton_gpu.py -k "main_grad or optimizer or clip" > $OUT/t1.log 2>&1; tail -4 $OUT/t1.log
  echo "at $(( $(date +%s) - t0 )) s"
  row one_new "" --trainers mtprun --warmup 1 --steps 4
  row one_base "$BASE" --trainers mtprun --warmup 1 --steps 4
  ;;
esac
