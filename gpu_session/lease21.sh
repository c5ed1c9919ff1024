# Twelfth session, second x2 lease: the overlapped reduce-scatter (fa65bd0) on GPU
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
OLDEP="PYTHONPATH=/tmp/site:$PWD/gpu_session/old_ep:$PWD/bench"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_main_grads_gpu.py tests/runner/test_data_parallel_gpu.py tests/runner/test_clip_in_step_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_triton_adamw_gpu.py tests/runner/test_experts_gpu.py tests/kernels/test_grouped_gemm_gpu.py "tests/kernels/test_triton_gpu.py" -k "not (test_triton_gpu and not (main_grad or device_once))" > $OUT/t.log 2>&1; tail -3 $OUT/t.log; grep -E "^(FAILED|ERROR)" $OUT/t.log | head
echo "tests at $(( $(date +%s) - t0 )) s"
cd bench
for t in new old new; do
  env_=""; [ $t = old ] && env_="$OLDEP"
  lim=150; [ ! -d /tmp/moe8 ] && lim=260
  CUDA_VISIBLE_DEVICES=0,1 env $env_ timeout $lim python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --model-dir /tmp/moe8 > $OUT/ep2_$t.log 2>&1
  grep -h '^{"trainer' $OUT/ep2_$t.log | cut -c1-300 | sed "s/^/$t /"; grep -h "Error" $OUT/ep2_$t.log | head -2
  echo "at $(( $(date +%s) - t0 )) s"
done
