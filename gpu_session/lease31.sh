# Lease 31 (eighteenth session, one H200): vLLM 0.26 reloads every parameter from a stream of
# weights (the transfer's receive); this session's GPU-side tests.
# calls 1-2: .carry/p1, .carry/p2 as lease30 (trainer site into /tmp/site)
# calls 3-10: carry .carry_v/pN: mkdir -p /tmp/chunks_v && cp .carry_v/pN/* /tmp/chunks_v/
# then: bash gpu_session/lease31.sh vsetup ; bash gpu_session/lease31.sh test
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
export PYTHONPATH=/tmp/site:/tmp/site_v:$PWD
case $1 in
vsetup)
  mkdir -p /tmp/site_v && cat /tmp/chunks_v/part_* | xz -d -T16 | tar -x -C /tmp/site_v
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
test)
  timeout 540 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/runner/test_engine_reload_gpu.py tests/runner/test_attention.py -k "stream or recomputation" > $OUT/t.log 2>&1
  grep -E "passed|failed|^E |Error" $OUT/t.log | head -30; echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
