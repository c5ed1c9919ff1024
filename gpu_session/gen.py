import json, sys, time, os
from vllm import LLM, SamplingParams
mode = sys.argv[1]
args = dict(model="/tmp/rl_gpu/models/2048x28-w", dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096)
if mode == "mtprun":
    args.update(enforce_eager=False, compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
t=time.perf_counter(); llm = LLM(**args); start=time.perf_counter()-t
sp = SamplingParams(max_tokens=1024, ignore_eos=True, temperature=1.0, logprobs=0, detokenize=False)
prompts = [{"prompt_token_ids": [5 + i % 50, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]} for i in range(256)]
for rep in range(2):
    t=time.perf_counter(); out = llm.generate(prompts, sp, use_tqdm=False); g=time.perf_counter()-t
    toks = sum(len(o.outputs[0].token_ids) for o in out)
    print(json.dumps({"mode": mode, "rep": rep, "start_s": start, "gen_s": g, "tok_per_s": toks / g}), flush=True)
