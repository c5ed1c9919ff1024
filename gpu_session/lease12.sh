# Lease 12 (nvidia-h100-x4): the deduplicated MoE exchange against megatron's, one GPU / ep=2 / ep=4
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# call 3: bash gpu_session/lease12.sh moe     call 4: bash gpu_session/lease12.sh ep4
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
setup)
  mkdir -p /tmp/site && cat /tmp/chunks/part_* | xz -d -T16 | tar -x -C /tmp/site
  find /tmp/site/ray/core /tmp/site/bin -type f -exec chmod +x {} + 2>/dev/null || true
  python3 -c "import ray, megatron.core, pydantic, torch; print('ray', ray.__version__, 'torch', torch.__version__); print(torch.nonzero_static(torch.eye(3, dtype=torch.bool, device='cuda'), size=3)[:, 1].tolist())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  ;;
moe)
  cd bench
  (export CUDA_VISIBLE_DEVICES=0
   for d in dedup megatron; do timeout 170 python3 moe_gpu.py --trainers mtprun --dispatchers $d --json $OUT/b_$d.json > $OUT/b_$d.log 2>&1; done
   timeout 150 python3 moe_gpu.py --trainers hf --json $OUT/b_hf.json > $OUT/b_hf.log 2>&1) &
  CUDA_VISIBLE_DEVICES=2,3 timeout 420 python3 moe_gpu.py --layers 8 --ep 2 --dispatchers dedup,megatron --json $OUT/c_ep2.json > $OUT/c_ep2.log 2>&1 &
  (cd .. && CUDA_VISIBLE_DEVICES=1 timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" tests/kernels/test_row_copies_triton.py tests/runner/test_experts_gpu.py > $OUT/gpu_tests.log 2>&1)
  tail -2 $OUT/gpu_tests.log
  wait; echo "moe at $(( $(date +%s) - t0 )) s"
  grep -h '^{' $OUT/b_*.log $OUT/c_ep2.log | cut -c1-330
  grep -h -i "error\|Traceback" $OUT/*.log | head -5
  ;;
ep4)
  cd bench
  timeout 330 python3 moe_gpu.py --layers 8 --ep 4 --dispatchers dedup,megatron --json $OUT/c_ep4.json > $OUT/c_ep4.log 2>&1
  echo "ep4 at $(( $(date +%s) - t0 )) s"; grep -h '^{' $OUT/c_ep4.log | cut -c1-330
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 moe_gpu.py --trainers mtprun --profile --json $OUT/b_prof.json > $OUT/b_prof.log 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 timeout 200 python3 moe_gpu.py --layers 8 --ep 2 --profile --json $OUT/c_prof.json > $OUT/c_prof.log 2>&1 &
  wait; echo "profiles at $(( $(date +%s) - t0 )) s"
  ;;
esac
