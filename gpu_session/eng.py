import cProfile, pstats, sys, time
from pathlib import Path
sys.path.insert(0, "bench")
from mtprun.runner.rollout.engine import RolloutEngine, Sampling
from mtprun.spec.rollout import RolloutSection
rollout = RolloutSection(max_tokens=1024, ignore_eos=True)
t = time.perf_counter()
eng = RolloutEngine(Path("/tmp/rl_gpu/models/2048x28-w"), rollout, 0, Path("/tmp/eng_work"), colocate=False)
print("start", time.perf_counter() - t, flush=True)
prompts = [[5 + i % 50, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] for i in range(32)]
for rep in range(2):
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    out = eng.generate(prompts, 8, Sampling(temperature=1.0, max_tokens=1024))
    prof.disable()
    print("gen", rep, time.perf_counter() - t, sum(len(s.token_ids) for g in out for s in g), flush=True)
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
pstats.Stats(prof).sort_stats("tottime").print_stats(15)
