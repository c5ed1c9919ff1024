# Lease 30 (seventeenth session, one H200): where a balanced long-tailed share's time goes now
# (after 82e9947's spans), recompute none and selective.
# call 1: carry .carry/p1: mkdir -p /tmp/chunks && cp .carry/p1/* /tmp/chunks/
# call 2: carry .carry/p2: cp .carry/p2/* /tmp/chunks/ && bash gpu_session/lease23.sh setup && bash gpu_session/lease30.sh prof
set -u
source gpu_session/env.sh; mkdir -p $OUT; t0=$(date +%s)
case $1 in
prof)
  for rc in none selective; do
    (cd bench && timeout 280 python3 balance_gpu.py --dp 2 --shares-alone --recompute $rc --steps 2 --draws 1 \
      --profile $OUT/prof_$rc --model-dir /tmp/bal_models --json $OUT/bal_$rc.json > $OUT/bal_$rc.log 2>&1)
    grep -h '^{' $OUT/bal_$rc.log | cut -c1-400; grep -h -i "error\|Traceback" $OUT/bal_$rc.log | head -3
    echo "$rc at $(( $(date +%s) - t0 )) s"
  done
  ;;
probe)
  timeout 400 python3 gpu_session/probe_rest.py 2>&1 | grep -v -i warn | tail -20; echo "at $(( $(date +%s) - t0 )) s"
  ;;
new)
  timeout 200 python3 gpu_session/probe_groups.py 2>&1 | grep -v -i warn | tail -12; echo "at $(( $(date +%s) - t0 )) s"
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_packed_attention_gpu.py tests/kernels/test_merged_attention_gpu.py 2>&1 | grep -E "groups|flex|passed|failed|Error" | tail -30
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
bal)  # new tree, then the tree before (gpu_session/base), recompute none
  for tree in new base; do
    pp=$PYTHONPATH; [ $tree = base ] && pp=/tmp/site:$PWD/gpu_session/base:$PWD
    (cd bench && PYTHONPATH=$pp timeout 280 python3 balance_gpu.py --dp 2 --shares-alone --steps 2 --draws 1 \
      --model-dir /tmp/bal_models --json $OUT/bal_$tree.json > $OUT/bal_$tree.log 2>&1)
    grep -h '^{' $OUT/bal_$tree.log | cut -c1-300; grep -h -i "error\|Traceback" $OUT/bal_$tree.log | head -3
    echo "$tree at $(( $(date +%s) - t0 )) s"
  done
  ;;
gtest)
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/kernels/test_packed_attention_gpu.py 2>&1 | grep -E "groups|flex|passed|failed|Error" | tail -30
  ;;
prof1)  # the new tree's profile, recompute none
  (cd bench && timeout 280 python3 balance_gpu.py --dp 2 --shares-alone --steps 2 --draws 1 \
    --profile $OUT/prof_new --model-dir /tmp/bal_models --json $OUT/bal_prof_new.json > $OUT/bal_prof_new.log 2>&1)
  grep -h '^{' $OUT/bal_prof_new.log | cut -c1-300; grep -h -i "error\|Traceback" $OUT/bal_prof_new.log | head -3
  echo "at $(( $(date +%s) - t0 )) s"
  ;;
esac
