# NEXT SESSION. Stage first (this checkout's .carry is gone with it):
#   ../shared/gpu/stage.sh megatron-core==0.16.1 "pydantic>=2.7,<3" "ruamel.yaml>=0.18" ray==2.52.1 dill   (2 parts, ~3 min)
#   call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
#   call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# Lease A: kind nvidia-h100-x1 (the 1.6x target's card): bash gpu_session/lease16.sh h100
# Lease B: kind nvidia-h100-x4 (or x2):                  bash gpu_session/lease16.sh ep
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
h100)  # one GPU ratio on the H100 (run 89 was H200: 1.58-1.61x), the weak-reference GPU test, varlen probe
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/runner/test_triton_adamw_gpu.py > $OUT/t.log 2>&1; tail -1 $OUT/t.log
  (cd bench && timeout 170 python3 moe_gpu.py --trainers mtprun,hf --model-dir /tmp/moe --json $OUT/b.json > $OUT/b.log 2>&1); grep -h '^{"trainer' $OUT/b.log | cut -c1-200
  timeout 120 python3 gpu_session/probe_varlen.py > $OUT/varlen.log 2>&1; tail -5 $OUT/varlen.log ;;
ep)  # where the ep = 2 step waits (profile), and megatron DDP's overlap of the dense grads (probe)
  cd bench
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8 --profile > $OUT/ep2_prof.log 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 MTPRUN_PROBE_OVERLAP=2 PYTHONPATH=$PWD/../gpu_session/probe_site:$PYTHONPATH timeout 300 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --model-dir /tmp/moe8b > $OUT/ep2_overlap.log 2>&1
  wait; grep -h '^{"trainer' $OUT/*.log | cut -c1-220; grep -h '^{"gpu_busy' $OUT/ep2_prof.log | cut -c1-400 ;;
esac
echo "at $(( $(date +%s) - t0 )) s"
# Then (design, issue 35 item 2): ep = 2 / 4 at equal parameters are 0.85x / 0.76x (run 89): the
# expert all-to-alls are not overlapped. Within one micro batch, computing the local rows while
# the remote rows' all-to-all flies needs two expert calls a layer, and each call's weight
# gradient is a float32 read-modify-write of every expert's main_grad (~1 ms a layer on an H200
# at 604M expert parameters a layer): it costs about what it hides at ep = 2, unless the weight
# gradients are deferred and computed once over both row sets. The overlap that keeps one
# weight-gradient pass per micro batch is across micro batches (one's forward exchange under the
# other's backward compute: megatron-core's combined 1F1B, overlap_moe_expert_parallel_comm, which
# needs GPTModel's build_schedule_plan forward, not the trainer's head-loss forward step: its
# forward_step_func must return (schedule plan, loss func) and the plan's post-process node
# computes megatron's logits, where mtprun's head loss would have to go (combined_1f1b.py); or our
# own two-micro-batch interleave in run_micro_batches). Autograd runs ready nodes latest-created
# first, so an async all-to-all split into start / wait Functions overlaps whatever was created
# between them, in forward and in backward, without side streams.
