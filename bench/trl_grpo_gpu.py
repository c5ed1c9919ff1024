"""TRL's GRPOTrainer on the workload of `bench/rl_gpu.py loop`, for the ratio against mtprun:
the same random-init model folder, prompts of the built-in `arithmetic` task, --group samples
each, responses of exactly --max-tokens tokens (vLLM's `ignore_eos`), one optimizer step per
generated batch, KL off (beta 0), bf16. TRL generates with vLLM colocated in its own process
(`vllm_mode="colocate"`, one GPU; the engine sleeps while the trainer steps), or with --server
on a second GPU (`trl vllm-serve` on GPU 1, the trainer on GPU 0, weights over NCCL; tokens per
second per GPU then divide by two).

Tokens per second per GPU: each step's prompt and completion tokens over its wall time (the
trainer's step callbacks), the median over the steps after the first.

    python bench/trl_grpo_gpu.py --model /tmp/rl_gpu/models/2048x28-w --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an HF folder (bench/rl_gpu.py builds it)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro batch")
    parser.add_argument("--utilization", type=float, default=0.35)
    parser.add_argument("--server", action="store_true", help="vLLM on GPU 1 (trl vllm-serve)")
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    args = parser.parse_args()
    server = start_server(args) if args.server else None

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mtprun.data.tasks import get_task

    drawn = get_task("arithmetic").prompts(args.prompts * (args.steps + 1), seed=0)
    # Conversational: TRL renders them with the folder's chat template, as mtprun does.
    prompts = [[{"role": "user", "content": p.messages[-1].content}] for p in drawn]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rendered = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    prompt_tokens = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in rendered]
    sequences = args.prompts * args.group
    config = GRPOConfig(
        output_dir="/tmp/trl_grpo",
        use_vllm=True,
        **(
            {"vllm_mode": "server", "vllm_server_base_url": SERVER}
            if args.server
            else {
                "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": args.utilization,
                "vllm_enable_sleep_mode": True,
            }
        ),
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        generation_kwargs={"ignore_eos": True},
        temperature=1.0,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=sequences // args.micro_batch,
        max_steps=args.steps,
        learning_rate=1e-6,
        beta=0.0,
        bf16=True,
        model_init_kwargs={"dtype": torch.bfloat16},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
    )
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    try:
        trainer.train()
    finally:
        if server is not None:
            server.terminate()
    tokens = sum(prompt_tokens[: args.prompts]) * args.group + sequences * args.max_tokens
    step_s = statistics.median(times[1:] or times)
    gpus = 2 if args.server else 1
    result = {
        "trainer": "trl",
        "placement": "server" if args.server else "colocate",
        "steps": len(times),
        "step_s": step_s,
        "throughput/tokens_per_s_per_gpu": tokens / step_s / gpus,
        "device": torch.cuda.get_device_name(0),
        "step_times": times,
    }
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(result) + "\n")


SERVER = "http://127.0.0.1:8011"


def start_server(args: argparse.Namespace) -> subprocess.Popen:
    """`trl vllm-serve` on GPU 1, waited for; this process then keeps GPU 0 alone."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    command = [
        sys.executable,
        "-c",
        "import sys, trl.cli; sys.exit(trl.cli.main())",
        "vllm-serve",
        "--model",
        args.model,
    ]
    command += ["--port", SERVER.rsplit(":", 1)[1], "--gpu-memory-utilization", "0.85"]
    server = subprocess.Popen(command, env=env)
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # before this process touches CUDA
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"trl vllm-serve exited ({server.returncode})")
        try:
            urllib.request.urlopen(f"{SERVER}/health", timeout=2)
            return server
        except OSError:
            time.sleep(2)
    server.terminate()
    raise SystemExit("trl vllm-serve did not answer in 10 minutes")


if __name__ == "__main__":
    main()
