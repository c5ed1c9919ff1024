# Session 9 lease (nvidia-h100-x4). call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# then: bash gpu_session/lease15.sh a ; bash gpu_session/lease15.sh b
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
OLD="PYTHONPATH=/tmp/site:$PWD/gpu_session/old"   # the tree before this session (0139e40)
case $1 in
a)  # one GPU 4 layers: new (GPU 0, then its profile) | old + transformers (GPU 1); GPU tests (GPU 2); 1.5B new, old (GPU 3)
  (export CUDA_VISIBLE_DEVICES=2
   timeout 450 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_triton_adamw_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_clip_in_step_gpu.py tests/runner/test_main_grads_gpu.py tests/runner/test_experts_gpu.py tests/kernels/test_grouped_gemm_gpu.py tests/kernels/test_grouped_wgrad_triton.py tests/kernels/test_row_copies_triton.py > $OUT/gpu_tests.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=3
   timeout 220 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 4096 --json $OUT/d15_new.json > $OUT/d15_new.log 2>&1
   env $OLD timeout 220 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 4096 --json $OUT/d15_old.json > $OUT/d15_old.log 2>&1) &
  cd bench
  (export CUDA_VISIBLE_DEVICES=0
   timeout 200 python3 moe_gpu.py --trainers mtprun --model-dir /tmp/moe0 --json $OUT/b_new.json > $OUT/b_new.log 2>&1
   timeout 150 python3 moe_gpu.py --trainers mtprun --model-dir /tmp/moe0 --profile > $OUT/b_new_prof.log 2>&1) &
  (export CUDA_VISIBLE_DEVICES=1
   env $OLD timeout 200 python3 moe_gpu.py --trainers mtprun --model-dir /tmp/moe1 --json $OUT/b_old.json > $OUT/b_old.log 2>&1
   timeout 150 python3 moe_gpu.py --trainers hf --model-dir /tmp/moe1 --json $OUT/b_hf.json > $OUT/b_hf.log 2>&1) &
  wait; tail -3 $OUT/gpu_tests.log; grep -h '^{"trainer' $OUT/*.log | cut -c1-260; grep -h "^| mtprun" $OUT/d15_*.log ;;
b)  # ep=2 at 8 layers (GPUs 0-1) | ep=4 at 4 layers (needs all four: after)
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 timeout 520 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8 --json $OUT/c_ep2_8.json > $OUT/c_ep2_8.log 2>&1
  grep -h '^{"trainer' $OUT/*.log | cut -c1-260 ;;
esac
echo "at $(( $(date +%s) - t0 )) s"
