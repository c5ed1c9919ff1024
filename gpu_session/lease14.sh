# NEXT SESSION (nvidia-h100-x4 if lent). Stage first (this checkout's .carry is gone with it):
#   ../shared/gpu/stage.sh megatron-core==0.16.1 "pydantic>=2.7,<3" "ruamel.yaml>=0.18" ray==2.52.1 dill   (2 parts, ~3 min)
#   call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
#   call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease12.sh setup
# Machine start costs ~75 s of device time; 8-layer MoE folders take minutes: --model-dir /tmp/moe
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s); cd bench
case $1 in
a)  # one GPU: where the dedup + folded-clip step goes now (the clip's 9.3 ms scale should be gone;
    # torch's fused AdamW writes grads back), bf16 moments; ep=2 at 8 layers side by side
  (export CUDA_VISIBLE_DEVICES=0
   timeout 150 python3 moe_gpu.py --trainers mtprun --profile --model-dir /tmp/moe > $OUT/b_prof.log 2>&1
   timeout 150 python3 moe_gpu.py --trainers mtprun --optimizer-state bfloat16 --model-dir /tmp/moe > $OUT/b_bf16.log 2>&1) &
  CUDA_VISIBLE_DEVICES=2,3 timeout 420 python3 moe_gpu.py --layers 8 --ep 2 --warmup 1 --steps 3 --dispatchers dedup,megatron --model-dir /tmp/moe > $OUT/ep2_8.log 2>&1
  wait; grep -h '^{"trainer' $OUT/*.log | cut -c1-300 ;;
b)  # ep=4 with the parameters a GPU holds equal to one GPU's 4 layers: 16 layers
  timeout 500 python3 moe_gpu.py --layers 16 --ep 4 --warmup 1 --steps 3 --model-dir /tmp/moe > $OUT/ep4_16.log 2>&1
  grep -h '^{"trainer' $OUT/ep4_16.log | cut -c1-300 ;;
esac
echo "at $(( $(date +%s) - t0 )) s"
# Then: float32 moments through mtprun.kernels.adamw (no grad write-back) against torch's fused
# AdamW (same bench, one GPU); torch.nn.attention.varlen.varlen_attn (FA2 varlen) against
# FlexAttention for the many-sequence rows (balance_gpu.py's balanced shares spend 0.5 s there);
# lease11.sh blocks A-C (fla float32 / TileLang: stage fla-core==0.6.0 tilelang; item 4 profiles).
