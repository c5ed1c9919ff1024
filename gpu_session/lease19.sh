# ELEVENTH SESSION (2026-11-28): the device budget was spent (155 s left, no machine could start): nothing below was run; run it as is.
# NEXT SESSION (written at the end of the tenth). Stage first (.carry may be gone):
#   ../shared/gpu/stage.sh megatron-core==0.16.1 "pydantic>=2.7,<3" "ruamel.yaml>=0.18" ray==2.52.1 dill   (2 parts)
#   call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
#   call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# Old tree for side by side, "before the pinned copies" (has the RMSNorm kernel and tp's work queue):
#   rm -rf gpu_session/old && mkdir gpu_session/old && git archive 436e08c mtprun | tar -x -C gpu_session/old
# NEVER run two benches at once on one host (run 90: rows 10-70% off). Remove gpu_session/old before `duplicates`.
# Lease A: kind nvidia-h100-x1 (the card): bash gpu_session/lease19.sh h100
# Lease B: kind nvidia-h100-x2:                     bash gpu_session/lease19.sh tp2
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
OLD="PYTHONPATH=/tmp/site:$PWD/gpu_session/old:$PWD/bench"
case $1 in
h100)  # 1.6x on the H100, 52% on the H100, the GPU tests written without a GPU
  timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/data/test_batch_copy_gpu.py tests/kernels/test_rms_norm.py tests/runner/test_triton_adamw_gpu.py tests/runner/test_main_grads_gpu.py tests/runner/test_optimizer_state_gpu.py tests/runner/test_clip_in_step_gpu.py tests/runner/test_experts_gpu.py > $OUT/t.log 2>&1; tail -3 $OUT/t.log
  cd bench
  timeout 200 python3 moe_gpu.py --trainers mtprun,hf --model-dir /tmp/moe > $OUT/moe.log 2>&1; grep -h '^{"trainer' $OUT/moe.log | cut -c1-200
  timeout 150 python3 trainer_gpu.py --workload sft,grpo --trainers mtprun --seq 4096 --model-dir /tmp/m15 > $OUT/d15.log 2>&1; grep -h '^{"trainer' $OUT/d15.log | cut -c1-200 ;;
tp2)  # the pinned copies on the host-bound tp=2 step: new, old, new (alternating; each its own process)
  cd bench
  for t in new old new; do
    env_=""; [ $t = old ] && env_="$OLD"
    CUDA_VISIBLE_DEVICES=0,1 env $env_ timeout 150 python3 trainer_gpu.py --shape qwen3-8b --tp 2 --optimizer-state bfloat16 --workload sft,grpo --seq 2048 --micro-batch-tokens 4096 --trainers mtprun --steps 6 --model-dir /tmp/m8 > $OUT/tp2_$t.log 2>&1
    grep -h '^{"trainer' $OUT/tp2_$t.log | python3 -c "import sys,json; [print('$t', d['workload'], d['step_s'], d['mfu']) for d in map(json.loads, sys.stdin)]"
  done ;;
ep)  # kind nvidia-h100-x2 (same lease as tp2 if time): ep = 2 plain, then DDP overlap (probe), alone
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --model-dir /tmp/moe8 > $OUT/ep2.log 2>&1
  CUDA_VISIBLE_DEVICES=0,1 MTPRUN_PROBE_OVERLAP=1 PYTHONPATH=$PWD/../gpu_session/probe_site:$PYTHONPATH timeout 200 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 4 --model-dir /tmp/moe8 > $OUT/ep2_overlap.log 2>&1
  grep -h '^{"trainer' $OUT/ep2*.log | cut -c1-240; grep -h "Error" $OUT/ep2*.log | head -3 ;;
esac
echo "at $(( $(date +%s) - t0 )) s"
# Then issue 35 item 2 (ep = 2 0.85x / ep = 4 0.76x at equal parameters; run 90's profile in
# bench/RESULTS.md): the exchange (a2a 14-23 ms, dense reduce-scatter + all-gather ~10 ms) and
# ~25 ms more idle than one GPU (twice the layers: the host's launches). Options, in order:
# (1) megatron DDP overlap_grad_reduce: needs every trained parameter's backward to hand DDP's
#     hook a gradient (megatron's dummy + grad_added_to_main_grad, as grouped_gemm does):
#     EmbeddingIntoMainGrad, FusedHeadLoss's output-layer path, and one more parameter that the
#     run-90 probe did not find (print the parameter's name in the assert: patch
#     DistributedDataParallel._make_backward_post_hook in the probe's sitecustomize).
# (2) the expert exchange overlapped: dispatch-backward all-to-all under the experts' weight
#     gradients (the experts' backward: dgrad, start the a2a, wgrad, wait), forward chunking was
#     slower (run 84); megatron's combined 1F1B needs two micro batches.
