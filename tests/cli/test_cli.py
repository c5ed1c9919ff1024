"""The `mtprun` command line: validate / plan / schema, as users and CI run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtprun.cli import main
from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.compiler.estimate import estimate_head_cost
from mtprun.preflight import load_recipe
from mtprun.preflight.memory import TrainerMemory, recipe_trainer_memory
from mtprun.spec.schema import recipe_json_schema

REPO = Path(__file__).resolve().parents[2]
MTPRUN = Path(sys.executable).parent / "mtprun"  # the installed console script

# A typo, a wrong type, an out-of-range value, an unknown loss kind and a broken cross-field
# rule (grpo without a task): the "five errors at once".
FIVE_ERRORS = """\
name: five
model:
  tiny: {hidden: 128, heads: 2, kv_heads: 1}
data:
  source: arithmetic
  packing_lenght: 256
trainer:
  steps: many
  lr: -1.0e-4
losses:
  - kind: grpo
  - kind: focal
"""


def _mtprun(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MTPRUN), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_shipped_recipes_validate() -> None:
    recipes = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*.yaml"))
    result = _mtprun("validate", *recipes)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for name in ("quickstart", "sft-zloss", "grpo-agentic", "mtp-specdec", "megatron-tp2"):
        assert name in result.stdout


def test_five_errors_at_once_exit_2_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "five.yaml").write_text(FIVE_ERRORS)
    result = _mtprun("validate", "five.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "five.yaml:6:3: unknown key 'packing_lenght' in 'data' (did you mean 'packing_length'?)",
        "five.yaml:8:10: trainer.steps: input should be a valid integer, unable to parse string "
        "as an integer (got 'many')",
        "five.yaml:9:7: trainer.lr: input should be greater than 0 (got -0.0001)",
        "five.yaml:11:11: loss 'grpo' trains on rollouts and needs a `task:` with a `reward:`",
        "five.yaml:12:11: losses.1: unknown loss kind 'focal'; allowed: ce, z_loss, grpo, "
        "entropy, distill, mtp, router_aux, router_z",
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert "5 error(s)" in result.stdout


def test_recipe_as_first_argument_is_run_and_checked_first(tmp_path: Path) -> None:
    (tmp_path / "five.yaml").write_text(FIVE_ERRORS)
    result = _mtprun("five.yaml", "trainer.steps=3", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 4  # the override fixed one of the five
    assert "Traceback" not in result.stdout + result.stderr


def test_yaml_syntax_error_exit_2_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("name: x\nmodel: {tiny: {}\n")
    result = _mtprun("validate", "broken.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "broken.yaml:3:1: YAML syntax error: expected ',' or '}', but got '<stream end>'"
    ]
    assert "Traceback" not in result.stdout


def test_validate_reports_every_file_and_applies_overrides_to_all(tmp_path, capsys) -> None:
    good = REPO / "recipes" / "sft-zloss.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(FIVE_ERRORS)
    code = main(["validate", str(good), str(bad), "trainer.steps=30"])
    out = capsys.readouterr()
    assert code == 2
    # The override fixed `steps: many`; the other four errors remain.
    assert len(out.err.splitlines()) == 4
    assert "sft-zloss" in out.out and "4 error(s)" in out.out


def test_plan_json_round_trips_to_the_compiled_plan(capsys) -> None:
    recipe_path = REPO / "recipes" / "mtp-specdec.yaml"
    assert main(["plan", str(recipe_path), "parallel.tp=1", "--json"]) == 0
    printed = capsys.readouterr().out
    assert HeadPlan.from_json(printed) == compile_recipe(load_recipe(recipe_path))


def test_plan_view_shows_passes_collectives_and_memory(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    recipe_path = REPO / "recipes" / "quickstart.yaml"
    overrides = ["parallel.tp=2", "model.tiny.kv_heads=2", "resources.num_cpus=3"]
    assert main(["plan", str(recipe_path), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "vocab passes" in out and "1 statistics pass" in out
    assert "collectives / micro batch" in out and "fused 1, unfused 6" in out
    assert "vocab 128" in out  # the 105-token char tokenizer, padded to a multiple of 128
    assert "head-loss memory / micro batch" in out


def test_plan_shows_the_policy_loss_options(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    recipe_path = REPO / "recipes" / "quickstart.yaml"
    overrides = [
        "losses.0={kind: grpo, ratio: sequence, clip_c: 3, tis_cap: 2, "
        "loss_agg: seq-mean-token-sum-norm}",
        "rollout.recompute_logprobs=true",
        "task.drop_uniform_groups=true",
    ]
    assert main(["plan", str(recipe_path), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dual-clip at 3 A where A < 0; GSPO sequence ratio" in out
    assert "truncated IS min(pi_old / pi_sampler, 2)" in out
    assert "recomputed by the trainer before each update" in out
    assert "equal-reward groups dropped, <= 4 rounds" in out
    assert "logprob_mismatch, is_weight_mean, is_clip_frac" in out  # the metrics row
    max_tokens = load_recipe(recipe_path).rollout.max_tokens
    assert f"token sums / {max_tokens} (constant)" in out
    assert main(["plan", str(recipe_path), *overrides, "--json"]) == 0
    plan = HeadPlan.from_json(capsys.readouterr().out)
    assert plan.sampler_logprobs and plan.norm_length == max_tokens and plan.sequence_ratio


def test_plan_of_an_invalid_recipe_exits_2(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(FIVE_ERRORS)
    assert main(["plan", str(bad)]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 5


def test_plan_without_the_model_folder_takes_the_head_shape(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    recipe_path = REPO / "recipes" / "megatron-tp2.yaml"
    assert main(["plan", str(recipe_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "config.json not readable here (give --head HIDDEN VOCAB)" in out and "grpo" in out

    assert main(["plan", str(recipe_path), "--head", "64", "1001"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    plan = compile_recipe(load_recipe(recipe_path))
    cost = estimate_head_cost(plan, rows=16384, hidden=64, vocab=1001, param_bytes=2)
    fused, unfused = cost.fused_bytes / 2**20, cost.unfused_bytes / 2**20
    assert "16384 rows x hidden 64 -> vocab 1001 (padded to 1002, a multiple of tp)" in out
    assert f"fused {fused:.2f} MiB, unfused {unfused:.2f} MiB" in out


def test_plan_counts_the_rows_of_one_context_parallel_rank(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    recipe_path = str(REPO / "recipes" / "megatron-tp2.yaml")  # 16384-token micro batches
    layout = ["parallel.cp=2", "resources.world_size=8"]
    assert main(["plan", recipe_path, *layout, "--head", "64", "1001"]) == 0
    assert "8192 rows x hidden 64" in " ".join(capsys.readouterr().out.split())


# Qwen2.5-7B's shape (the bench model), as a config.json without weights.
QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
}


def _qwen_7b(tmp_path: Path) -> list[str]:
    """Overrides that point megatron-tp2.yaml (tp 2 x dp 2, bf16) at a 7B-shaped folder."""
    folder = tmp_path / "qwen-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    return [f"model.path={folder}"]


@pytest.mark.parametrize(
    ("overrides", "tied", "summed"),
    [
        (["model.dtype=float32"], False, "float32 gradients; all-reduced over dp x cp = 2 ranks "),
        (["parallel.dp=1", "parallel.pp=2"], False, "float32 main gradients │"),
        (
            ["parallel.tp=1", "parallel.pp=2"],
            True,
            "reduce-scattered over dp x cp = 2 ranks after the backward, not during it: the tied "
            "embedding's two stages sum their gradients first",
        ),
        (["parallel.tp=1", "parallel.pp=2"], False, "2 ranks during the backward"),
    ],
)
def test_plan_says_when_the_ranks_sum_the_gradients(
    tmp_path, capsys, monkeypatch, overrides, tied, summed
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    folder = tmp_path / "qwen-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN_7B, "tie_word_embeddings": tied}))
    recipe_path = REPO / "recipes" / "megatron-tp2.yaml"
    assert main(["plan", str(recipe_path), f"model.path={folder}", *overrides]) == 0
    assert summed in " ".join(capsys.readouterr().out.split())


def test_plan_shows_the_trainer_memory_per_rank(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    recipe_path = REPO / "recipes" / "megatron-tp2.yaml"
    overrides = [*_qwen_7b(tmp_path), "trainer.recompute=full"]
    assert main(["plan", str(recipe_path), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    memory = recipe_trainer_memory(load_recipe(recipe_path, overrides))
    assert isinstance(memory, TrainerMemory)
    assert "trainer memory per rank" in out
    gib = {name: f"{n / 2**30:.2f}" for name, n in memory.parts().items()}
    assert f"weights │ {gib['weights']} │ bf16 compute weights" in out
    assert (
        f"gradients │ {gib['gradients']} │ float32 main gradients; reduce-scattered over dp x cp = "
        "2 ranks during the backward" in out
    )
    assert (
        f"optimizer state │ {gib['optimizer']} │ AdamW: float32 master weights, exp_avg, "
        "exp_avg_sq; sharded over dp x cp = 2 ranks" in out
    )
    assert (
        f"activations (recompute: full) │ {gib['activations']} │ 16384 tokens x 28 layers x 1 "
        "micro batch in flight, bfloat16, flash attention" in out
    )
    assert f"head loss │ {gib['head_loss']} │ fused buffers of one micro batch" in out
    assert f"total │ {memory.total / 2**30:.2f} │ a floor" in out
    # Half of 7.6B parameters per tensor-parallel rank, in bf16.
    assert 6.8 < memory.weights / 2**30 < 7.4 and memory.tokens == 16384

    overrides += ["resources.gpu_memory_gib=80", "trainer.recompute=none"]
    assert main(["plan", str(recipe_path), *overrides]) == 0
    captured = capsys.readouterr()
    assert "exceeds resources.gpu_memory_gib 80" in " ".join(captured.out.split())
    assert "warning: the trainer needs an estimated" in captured.err  # validate's warning too


def test_plan_memory_of_a_model_not_at_hand_is_unknown(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    recipe_path = REPO / "recipes" / "megatron-tp2.yaml"
    assert main(["plan", str(recipe_path), "--head", "3584", "152064"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "trainer memory per rank" in out
        and "model shape │ unknown: /models/Qwen2.5-7B-Instruct/config.json not readable here"
        in out
    )
    assert main(["plan", str(recipe_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer_memory"] is None


def test_plan_json_carries_the_trainer_memory_beside_the_plan(tmp_path, capsys) -> None:
    recipe_path = REPO / "recipes" / "megatron-tp2.yaml"
    overrides = _qwen_7b(tmp_path)
    assert main(["plan", str(recipe_path), *overrides, "--json"]) == 0
    printed = capsys.readouterr().out
    recipe = load_recipe(recipe_path, overrides)
    assert HeadPlan.from_json(printed) == compile_recipe(recipe)  # still round-trips
    memory = recipe_trainer_memory(recipe)
    assert isinstance(memory, TrainerMemory)
    data = json.loads(printed)["trainer_memory"]
    assert data == memory.to_dict()
    assert data["total"] == sum(
        data[k] for k in ("weights", "gradients", "optimizer", "activations", "head_loss")
    )
    assert data["recompute"] == "none" and data["optimizer_shards"] == 2


def test_validate_warns_about_memory_and_still_exits_0(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "megatron-tp2.yaml").read_text())
    overrides = [*_qwen_7b(tmp_path), "resources.gpu_memory_gib=60"]
    result = _mtprun("validate", "r.yaml", *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [warning] = result.stderr.splitlines()
    assert warning.startswith("<override 2>:1:26: warning: the trainer needs an estimated")
    assert "1 warning(s)" in result.stdout
    result = _mtprun("validate", "r.yaml", *overrides, "trainer.recompute=full", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""


def test_schema_written_with_o_is_the_recipe_schema(tmp_path: Path) -> None:
    target = tmp_path / "schema.json"
    assert main(["schema", "-o", str(target)]) == 0
    assert json.loads(target.read_text()) == recipe_json_schema()


def test_schema_to_stdout(capsys) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["properties"]["name"]["type"] == "string"


def test_unknown_command_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_validate_needs_a_file(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["validate"])
    assert "the following arguments are required" in capsys.readouterr().err


def test_validate_with_only_overrides_is_an_error(capsys) -> None:
    assert main(["validate", "trainer.lr=1"]) == 2
    assert "no recipe file given" in capsys.readouterr().err


def test_validate_never_imports_torch() -> None:
    # Command modules import heavy dependencies inside their `func`: `mtprun validate` in CI
    # and editors must not pay for torch, ray or vllm.
    code = (
        "import sys; from mtprun.cli import main; "
        "code = main(['validate', 'recipes/quickstart.yaml']); "
        "heavy = {'torch', 'transformers', 'ray', 'vllm'} & set(sys.modules); "
        "assert code == 0 and not heavy, (code, heavy)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_plan_head_shape_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(REPO / "recipes" / "megatron-tp2.yaml"), "--head", "0", "1000"])
    assert exit_info.value.code == 2
    assert "expected a positive integer, got '0'" in capsys.readouterr().err


def test_schema_to_an_unwritable_place(tmp_path: Path, capsys) -> None:
    target = tmp_path / "missing-folder" / "schema.json"
    assert main(["schema", "-o", str(target)]) == 2
    assert f"cannot write {target}: No such file or directory" in capsys.readouterr().err


def test_plan_shows_the_rl_loop_and_the_weights_it_moves(tmp_path, capsys, monkeypatch) -> None:
    from safetensors.torch import load_file

    from mtprun.data.tokenizer import build_tokenizer
    from mtprun.models import build_tiny_model

    monkeypatch.setenv("COLUMNS", "200")
    recipe_path = REPO / "recipes" / "quickstart.yaml"
    overrides = [
        "rollout.max_staleness=2",
        "rollout.num_engines=3",
        "resources.num_cpus=4",
        "rollout.weight_transfer=object_store",
        "model.dtype=bfloat16",
    ]
    assert main(["plan", str(recipe_path), *overrides, "--json"]) == 0
    loop = json.loads(capsys.readouterr().out)["rollout_loop"]
    # What an engine receives is the HF folder the trainer exports: count its parameters.
    recipe = load_recipe(recipe_path, overrides)
    folder = build_tiny_model(recipe.model.tiny, build_tokenizer("char"), tmp_path / "m", seed=0)
    params = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    assert loop == {
        "max_staleness": 2,
        "placement": "split",
        "weight_transfer": "object_store",
        "engines": 3,
        "sync_bytes_per_engine": params * 2,
        "sync_bytes_per_step": params * 2 * 3,
        "colocated_memory": None,
    }
    assert main(["plan", str(recipe_path), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "asynchronous: engines generate up to 2 step(s) ahead of the trainer" in out
    assert "object store: trainer rank 0 puts the weights in Ray's object store" in out
    assert main(["plan", str(REPO / "recipes" / "sft-zloss.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rollout_loop"] is None


def test_commands_switch_library_usage_reports_off_unless_the_user_set_them(monkeypatch) -> None:
    """What MLflow, vLLM and Ray read as their reporting switches after any command: off,
    except where the user had set one (that setting stays)."""
    for name in ("MLFLOW_DISABLE_TELEMETRY", "RAY_USAGE_STATS_ENABLED", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")  # this user wants vLLM's reports
    assert main(["validate", str(REPO / "recipes" / "quickstart.yaml")]) == 0
    from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY
    from ray._common.usage.usage_lib import usage_stats_enabled
    from vllm import envs

    assert MLFLOW_DISABLE_TELEMETRY.get() is True
    assert usage_stats_enabled() is False
    assert envs.VLLM_NO_USAGE_STATS is False
