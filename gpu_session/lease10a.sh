# call 11: GPU0 tests of the changed CUDA paths; GPU1 Qwen3.5 8 layers cp=1 at 32k (fla compile first)
source gpu_session/env.sh; mkdir -p $OUT
pip install -q --no-index --no-deps --target /tmp/site .gdn_gpu/fla_core-*.whl 2>&1 | tail -1
(CUDA_VISIBLE_DEVICES=1 timeout 540 python3 bench/trainer_gpu.py --shape qwen3.5-9b --layers 8 --trainers mtprun --cp 1 --seq 32768 --step-tokens 32768 --workload sft --model-dir /tmp/q35 --json $OUT/q35_cp1.json > $OUT/q35_cp1.log 2>&1; echo "q35 cp1 rc=$?" >> $OUT/q35_cp1.log) &
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -x -q -s -p no:cacheprovider -o addopts="" tests/runner/test_main_grads_gpu.py tests/runner/test_optimizer_state_gpu.py tests/kernels/test_merged_attention_gpu.py > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -15 $OUT/tests.log
CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_gated_delta_gpu.py -k "fp32 or float32" > $OUT/gdn_fp32.log 2>&1; echo "gdn rc=$?"; grep -iE "error|assert|passed|failed" $OUT/gdn_fp32.log | tail -20
wait; tail -5 $OUT/q35_cp1.log
