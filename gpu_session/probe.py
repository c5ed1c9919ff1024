"""GPU1 probe: is the colocated engine's generation slow because of sleep mode, a sleep/wake
cycle, or the Ray actor? Prints one JSON line per measurement."""
import json, os, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file
from mtprun.runner.rollout.engine import RolloutEngine, Sampling
from mtprun.spec.rollout import RolloutSection

FOLDER = Path("/tmp/rl_gpu/models/2048x28-w")
rollout = RolloutSection(max_tokens=1024, ignore_eos=True)
prompts = [[5 + i % 50, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] for i in range(32)]
sampling = Sampling(temperature=1.0, max_tokens=1024)

def gen(eng, label):
    t = time.perf_counter()
    out = eng.generate(prompts, 8, sampling)
    s = time.perf_counter() - t
    toks = sum(len(x.token_ids) for g in out for x in g)
    print(json.dumps({"probe": label, "gen_s": round(s, 2), "tokens": toks, "free_gib": torch.cuda.mem_get_info()[0] / 2**30}), flush=True)

mode = sys.argv[1]
if mode == "inproc":
    t = time.perf_counter()
    eng = RolloutEngine(FOLDER, rollout, 0, Path("/tmp/probe_eng"), colocate=True)
    print(json.dumps({"probe": "start_colocate", "s": time.perf_counter() - t}), flush=True)
    gen(eng, "colocate_fresh")
    weights = {}
    for f in sorted(FOLDER.glob("*.safetensors")):
        weights.update(load_file(str(f), device="cuda"))
    for cycle in range(2):
        print(json.dumps({"probe": "sleep", "s": eng.sleep(), "free_gib": torch.cuda.mem_get_info()[0] / 2**30}), flush=True)
        print(json.dumps({"probe": "reload", "s": eng.update_weights(weights.items(), cycle + 1)}), flush=True)
        gen(eng, f"after_sleep_wake_{cycle}")
elif mode == "actor":
    import ray
    from mtprun.runner.rollout.worker import RolloutWorker
    ray.init(num_gpus=1)
    w = ray.remote(RolloutWorker).options(num_gpus=1).remote(str(FOLDER), rollout, 0, "/tmp/probe_actor", None, 0, False, None, False)
    for rep in range(2):
        t = time.perf_counter()
        out = ray.get(w.generate.remote(prompts, 8, sampling))
        print(json.dumps({"probe": f"ray_actor_{rep}", "gen_s": round(time.perf_counter() - t, 2), "engine": ray.get(w.take_generated.remote())}), flush=True)
