# Twelfth session (2026-11-28), kind nvidia-h200-x2. After setup (lease12.sh setup):
#   call 3: bash gpu_session/lease20.sh ep      call 4: bash gpu_session/lease20.sh tp2
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
OLD="PYTHONPATH=/tmp/site:$PWD/gpu_session/old:$PWD/bench"
OLDEP="PYTHONPATH=/tmp/site:$PWD/gpu_session/old_ep:$PWD/bench"
row() { grep -h '^{"trainer' $2 | python3 -c "import sys,json; [print('$1', d.get('workload',''), d.get('step_s', d.get('step_ms','')), d.get('mfu','')) for d in map(json.loads, sys.stdin)]"; }
case $1 in
ep)  # ep = 2: the late host read (new) against 6d4fce4 (old), alternating
  cd bench
  for t in new old new; do
    env_=""; [ $t = old ] && env_="$OLDEP"
    lim=150; [ ! -d /tmp/moe8 ] && lim=260
    CUDA_VISIBLE_DEVICES=0,1 env $env_ timeout $lim python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --model-dir /tmp/moe8 > $OUT/ep2_$t.log 2>&1
    grep -h '^{"trainer' $OUT/ep2_$t.log | cut -c1-260 | sed "s/^/$t /"; grep -h "Error" $OUT/ep2_$t.log | head -2
    echo "at $(( $(date +%s) - t0 )) s"
  done ;;
tp2)  # GPU tests, then the pinned copies on the host-bound tp = 2 step: new, old (436e08c)
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" tests/data/test_batch_copy_gpu.py tests/kernels/test_rms_norm.py tests/runner/test_triton_adamw_gpu.py tests/runner/test_main_grads_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_clip_in_step_gpu.py tests/runner/test_experts_gpu.py > $OUT/t.log 2>&1; tail -3 $OUT/t.log
  echo "tests at $(( $(date +%s) - t0 )) s"
  cd bench
  for t in new old; do
    env_=""; [ $t = old ] && env_="$OLD"
    lim=150; [ ! -d /tmp/m8 ] && lim=240
    CUDA_VISIBLE_DEVICES=0,1 env $env_ timeout $lim python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 6 --model-dir /tmp/m8 > $OUT/tp2_$t.log 2>&1
    row $t $OUT/tp2_$t.log; grep -h "Error" $OUT/tp2_$t.log | head -2
    echo "at $(( $(date +%s) - t0 )) s"
  done ;;
probe)  # ep = 2 with megatron DDP's overlapped reduce-scatter (probe sitecustomize)
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 MTPRUN_PROBE_OVERLAP=1 PYTHONPATH=$PWD/../gpu_session/probe_site:$PYTHONPATH timeout 150 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --model-dir /tmp/moe8 > $OUT/ep2_overlap.log 2>&1
  grep -h '^{"trainer' $OUT/ep2_overlap.log | cut -c1-260; grep -h "Error\|assert" $OUT/ep2_overlap.log | head -5 ;;
esac
echo "done at $(( $(date +%s) - t0 )) s"
