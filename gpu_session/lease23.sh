# Lease 23 (thirteenth session, nvidia-h200-x2).
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease23.sh setup
# call 3: carry .carry_fla/p1: bash gpu_session/lease23.sh fla   (fla-core 0.6.0 + tilelang 0.1.15 into /tmp/site_fla)
# call 4: bash gpu_session/lease23.sh q35mt   (mtprun rows; GPU tests on GPU 1 meanwhile)
# call 5: bash gpu_session/lease23.sh q35hf ; call 6: bash gpu_session/lease23.sh ep2
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
Q35="--shape qwen3.5-9b --layers 8 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --optimizer-state bfloat16 --model-dir /tmp/q35"
case $1 in
setup)
  mkdir -p /tmp/site && cat /tmp/chunks/part_* | xz -d -T16 | tar -x -C /tmp/site
  find /tmp/site/ray/core /tmp/site/bin -type f -exec chmod +x {} + 2>/dev/null || true
  python3 -c "import ray, megatron.core, pydantic, torch; print('ray', ray.__version__, 'torch', torch.__version__)"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  ;;
fla)
  mkdir -p /tmp/site_fla && xz -dc .carry_fla/p1/part_00 | tar -x -C /tmp/site_fla
  PYTHONPATH=/tmp/site_fla:$PYTHONPATH python3 -c "import fla, tilelang; from mtprun.kernels.gated_delta_fla import fla_backward_is_safe; print('fla', fla.__version__, 'tilelang', tilelang.__version__)" 2>&1 | tail -2
  ;;
q35mt)
  (CUDA_VISIBLE_DEVICES=1 timeout 500 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_triton_gpu.py -k "main_grad or device_once" tests/runner/test_main_grads_gpu.py > $OUT/t1.log 2>&1) &
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site_fla:$PYTHONPATH timeout 560 python3 bench/trainer_gpu.py $Q35 --trainers mtprun --json $OUT/q35_mtprun.json > $OUT/q35_mtprun.log 2>&1
  grep "^| " $OUT/q35_mtprun.log | tail -4; grep -h -i "error\|Traceback" $OUT/q35_mtprun.log | head -3
  wait; tail -2 $OUT/t1.log; echo "at $(( $(date +%s) - t0 )) s"
  ;;
q35hf)
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site_fla:$PYTHONPATH timeout 560 python3 bench/trainer_gpu.py $Q35 --trainers hf --json $OUT/q35_hf.json > $OUT/q35_hf.log 2>&1
  grep "^| " $OUT/q35_hf.log | tail -4; grep -h -i "error\|Traceback" $OUT/q35_hf.log | head -3; echo "at $(( $(date +%s) - t0 )) s"
  ;;
ep2)
  timeout 300 python3 bench/moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --profile --model-dir /tmp/moe --json $OUT/ep2.json > $OUT/ep2.log 2>&1
  grep -h '^{"trainer' $OUT/ep2.log | cut -c1-900; grep -h -i "error\|Traceback" $OUT/ep2.log | head -3
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_data_parallel_gpu.py > $OUT/t2.log 2>&1; tail -2 $OUT/t2.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
q35prof)
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site_fla:$PYTHONPATH timeout 500 python3 bench/trainer_gpu.py ${Q35/sft,grpo/sft} --trainers mtprun --warmup 2 --steps 3 --profile $OUT/q35prof > $OUT/q35prof.log 2>&1
  grep "^| " $OUT/q35prof.log | tail -2; grep -h -i "error\|Traceback" $OUT/q35prof.log | head -3
  ls ~/.tilelang 2>/dev/null && tar -C ~ -cJf $OUT/tilelang_cache.tar.xz .tilelang && ls -la $OUT/tilelang_cache.tar.xz
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
q35adam)  # one H200: the hashed stochastic rounding (AdamW) on the Qwen3.5 rows, then its GPU tests
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site_fla:$PYTHONPATH timeout 420 python3 bench/trainer_gpu.py $Q35 --trainers mtprun --profile $OUT/q35adam --json $OUT/q35_mtprun2.json > $OUT/q35_mtprun2.log 2>&1
  grep "^| " $OUT/q35_mtprun2.log | tail -2; grep -h -i "error\|Traceback" $OUT/q35_mtprun2.log | head -3; echo "at $(( $(date +%s) - t0 )) s"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_adamw_kernel.py tests/runner/test_triton_adamw_gpu.py tests/runner/test_optimizer_state_gpu.py > $OUT/t3.log 2>&1; tail -2 $OUT/t3.log
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
