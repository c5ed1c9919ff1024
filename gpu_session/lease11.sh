# NEXT SESSION (stage first; two GPUs). Each block its own call (<600 s).
# A: the GPU tests not re-run since their last change (fla float32 -> torch backward 35f3b6d; the
#    spans test moved in 21a1979), carry .gdn_gpu and pip install its fla wheel to /tmp/site first
source gpu_session/env.sh; mkdir -p $OUT
pip install -q --no-index --no-deps --target /tmp/site .gdn_gpu/fla_core-*.whl
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_gated_delta_gpu.py -k "fp32" > $OUT/gdn_fp32.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_packed_attention_gpu.py tests/kernels/test_merged_attention_gpu.py > $OUT/attn.log 2>&1 &
wait; tail -3 $OUT/gdn_fp32.log $OUT/attn.log
# B: item 4, profiles: Qwen3-8B tp=2 (target 45% MFU on H100s) and the 1.5B shape on one GPU (52%)
timeout 300 python3 bench/trainer_gpu.py --shape qwen3-8b --tp 2 --workload sft --trainers mtprun --seq 4096 --profile $OUT/tp2 > $OUT/tp2.log 2>&1; grep "^| mtprun" $OUT/tp2.log
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 bench/trainer_gpu.py --workload sft --trainers mtprun --seq 4096 --profile $OUT/d15 > $OUT/d15.log 2>&1; grep "^| mtprun" $OUT/d15.log
# C: Qwen3.5 cp=2 profile (80% scaling in run 86): where the GDN hand-off goes
timeout 300 python3 bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun --cp 2 --seq 32768 --step-tokens 32768 --workload sft --steps 2 --warmup 1 --model-dir /tmp/q35 --profile $OUT/q35p > $OUT/q35p.log 2>&1; grep "^| mtprun" $OUT/q35p.log
