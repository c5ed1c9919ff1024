source gpu_session/env.sh
mkdir -p $OUT
timeout ${T:-560} python3 -m pytest -m gpu -x -q -p no:cacheprovider tests/runner/test_rl_gpu.py ${K:+-k "$K"} -o addopts="" 2>&1 | tee $OUT/gpu_tests.log | tail -40
