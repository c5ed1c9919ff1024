"""Served reward models (`task.reward: {model, kind}`) as `mtprun validate` and `mtprun plan`
check and show them: every problem at its value (folder, architecture, labels, template,
parse function), their actors in the run's CPU/GPU demand, their memory from config.json."""

from __future__ import annotations

import json
from pathlib import Path

from mtprun.preflight import check_recipe
from mtprun.preflight.reward_models import served_models
from mtprun.spec.actors import ActorDemand, served_engines

HEAD = """\
name: t
model:
  tiny:
    hidden: 128
    heads: 2
    kv_heads: 1
losses: [{kind: grpo}]
task:
  name: arithmetic
"""  # the task's reward starts on line 10

QWEN2_CORE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def model_folder(
    folder: Path, architecture: str, labels: int = 1, chat_template: bool = True, **config: object
) -> Path:
    """An HF folder as validate reads it: config.json (a classifier's labels as transformers
    writes them: id2label) and tokenizer_config.json, no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"architectures": [architecture], **QWEN2_CORE, **config}
    if architecture.endswith("ForSequenceClassification"):
        fields["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
    (folder / "config.json").write_text(json.dumps(fields))
    template = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(template if chat_template else {}))
    return folder


def test_a_classifier_folder_is_relative_and_checked(write_recipe, located, tmp_path) -> None:
    path = write_recipe(HEAD + "  reward: {model: rm, kind: classifier}\n")
    assert located(path) == [f"{path}:10:19: reward model folder not found: {tmp_path}/rm"]
    model_folder(tmp_path / "rm", "Qwen2ForCausalLM")
    [found] = located(path)
    assert found.startswith(
        f"{path}:10:19: {tmp_path}/rm/config.json: architectures ['Qwen2ForCausalLM'] is not a "
        "*ForSequenceClassification checkpoint"
    )
    assert "use kind: judge" in found
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification", labels=3)
    assert located(path) == [
        f"{path}:10:19: {tmp_path}/rm/config.json: the classifier has 3 labels; set score_label "
        "to the label whose logit is the reward"
    ]
    three = HEAD + "  reward: {model: rm, kind: classifier, score_label: 3}\n"
    assert located(write_recipe(three, "three.yaml")) == [
        f"{tmp_path}/three.yaml:10:54: score_label 3 but {tmp_path}/rm/config.json has 3 "
        "labels (0 to 2)"
    ]
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification", chat_template=False)
    assert located(path) == [
        f"{path}:10:19: {tmp_path}/rm has no chat template to render the conversation with"
    ]
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification")
    assert located(path) == []
    recipe = check_recipe(path).recipe
    assert recipe.task.reward.model == f"{tmp_path}/rm"


def test_a_judge_template_and_parse_function_are_checked(write_recipe, located, tmp_path) -> None:
    model_folder(tmp_path / "judge", "Qwen2ForCausalLM")
    (tmp_path / "p.txt").write_text("{question} -> {completion} ({answr})")
    judge = "  reward: {model: judge, kind: judge, prompt: p.txt, parse: 'parse.py:score'}\n"
    path = write_recipe(HEAD + judge)
    found = located(path)
    assert len(found) == 2, found
    assert found[0].startswith(
        f"{path}:10:47: {tmp_path}/p.txt: the template's field {{answr}} is not one mtprun fills "
        "(did you mean 'answer'?)"
    )
    assert found[1] == f"{path}:10:61: file not found: {tmp_path}/parse.py"
    (tmp_path / "p.txt").write_text("{question} -> {completion} ({answer})")
    (tmp_path / "parse.py").write_text("def scor(reply):\n    return 1.0\n")
    assert located(path) == [
        f"{path}:10:61: {tmp_path}/parse.py has no attribute 'score' (did you mean 'scor'?)"
    ]
    # A file is imported once per process (validate and the run share it): a new one.
    (tmp_path / "good.py").write_text("def score(reply):\n    return 1.0\n")
    path = write_recipe(HEAD + judge.replace("parse.py", "good.py"))
    assert located(path) == []
    assert check_recipe(path).recipe.task.reward.parse == f"{tmp_path}/good.py:score"
    model_folder(tmp_path / "judge", "Qwen2ForSequenceClassification")
    [found] = located(path)
    assert found.startswith(f"{path}:10:32: {tmp_path}/judge/config.json: architectures")
    assert found.endswith("is a sequence classifier, which writes no text: use kind: classifier")


def test_the_fields_of_the_other_kind_are_refused(write_recipe, located) -> None:
    path = write_recipe(HEAD + "  reward: {model: rm, kind: judge}\n")
    [found] = located(path)
    assert "a judge (kind: judge) needs `prompt: <template file>`" in found
    path = write_recipe(HEAD + "  reward: {model: rm, kind: classifier, parse: '(\\d)'}\n")
    [found] = located(path)
    assert "parse: a judge's field(s); a classifier (kind: classifier) scores" in found


def test_an_endpoint_judge_parse_function_is_checked(write_recipe, located, tmp_path) -> None:
    (tmp_path / "p.txt").write_text("{completion}")
    judge = (
        "  reward: {url: 'http://127.0.0.1:9/v1', model: m, prompt: p.txt, parse: 'no.such:f'}\n"
    )
    path = write_recipe(HEAD + judge)
    [found] = located(path)
    assert found.startswith(f"{path}:10:74: no module named 'no.such'")


def test_served_models_count_in_the_actors_and_show_their_memory(
    write_recipe, located, tmp_path
) -> None:
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification", dtype="bfloat16")
    model_folder(tmp_path / "judge", "Qwen2ForCausalLM")
    (tmp_path / "p.txt").write_text("{completion}")
    rewards = (
        "  rewards:\n"
        "    - {reward: arithmetic}\n"
        "    - {model: rm, kind: classifier, weight: 0.5}\n"
        "    - {model: judge, kind: judge, prompt: p.txt, name: j}\n"
        "resources: {num_cpus: 3}\n"
    )
    path = write_recipe(HEAD + rewards)
    [found] = located(path)
    assert found.startswith(
        f"{path}:14:23: the run's actors need 4 CPUs at once, 1 trainer rank (tp*pp*cp*dp) + 1 "
        "rollout engine (rollout.num_engines) + 2 served reward models (task.reward(s)) at "
        "resources.cpus_per_actor 1 each"
    )
    recipe = check_recipe(path, ["resources.num_cpus=4"]).recipe
    assert ActorDemand.of(recipe).need("CPU") == 4
    rm, judge = served_models(recipe)
    h, v, f, layers = 64, 128, 128, 2
    layer = h * (h + 2 * h) + (h + 2 * h) + h * h + 2 * h + 3 * f * h  # qkv(+bias), o, norms, mlp
    trunk = v * h + layers * layer + h  # embedding, layers, final norm
    assert (rm.parameters, rm.dtype, rm.weight_bytes) == (trunk + h, "bfloat16", 2 * (trunk + h))
    assert (judge.parameters, judge.weight_bytes) == (trunk + v * h, 4 * (trunk + v * h))
    assert rm.to_dict()["where"] == "task.rewards.1" and judge.spec.kind == "judge"


def test_terms_serving_one_folder_and_kind_count_as_one_engine(write_recipe, located, tmp_path):
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification")
    model_folder(tmp_path / "judge", "Qwen2ForCausalLM")
    (tmp_path / "p.txt").write_text("{completion}")
    (tmp_path / "q.txt").write_text("Rate: {completion}")
    rewards = (
        "  rewards:\n"
        "    - {model: rm, kind: classifier}\n"
        "    - {model: judge, kind: judge, prompt: p.txt, name: a}\n"
        "    - {model: ./judge, kind: judge, prompt: q.txt, name: b, max_tokens: 4}\n"
        "resources: {num_cpus: 3}\n"
    )
    [found] = located(write_recipe(HEAD + rewards))
    assert "the run's actors need 4 CPUs at once" in found, found
    assert "+ 2 served reward models (task.reward(s))" in found, found
    recipe = check_recipe(write_recipe(HEAD + rewards), ["resources.num_cpus=4"]).recipe
    assert ActorDemand.of(recipe).reward_models == 2
    engines = [[where for where, _ in terms] for terms in served_engines(recipe)]
    assert engines == [[("task", "rewards", 0)], [("task", "rewards", 1), ("task", "rewards", 2)]]


def test_plan_shows_the_served_models(tmp_path, capsys, monkeypatch) -> None:
    from mtprun.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification")
    path = tmp_path / "r.yaml"
    path.write_text(HEAD + "  reward: {model: rm, kind: classifier}\nresources: {num_cpus: 3}\n")
    assert main(["plan", str(path), "--json"]) == 0
    [shown] = json.loads(capsys.readouterr().out)["reward_models"]
    assert shown["where"] == "task.reward" and shown["architecture"].endswith("Classification")
    assert (shown["cpus"], shown["gpus"], shown["dtype"]) == (1.0, 0.0, "float32")
    assert shown["weight_bytes"] == 4 * shown["parameters"]
    assert main(["plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "served reward models" in text and "Qwen2ForSequenceClassification" in text
    assert "the run's actors reserve 3 CPUs and 0 GPUs at once (1 trainer ranks, 1 rollout " in (
        " ".join(text.split())
    )


def test_validate_shows_the_served_models_and_the_actors(tmp_path, capsys, monkeypatch) -> None:
    from mtprun.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    model_folder(tmp_path / "rm", "Qwen2ForSequenceClassification")
    path = tmp_path / "r.yaml"
    path.write_text(HEAD + "  reward: {model: rm, kind: classifier}\nresources: {num_cpus: 3}\n")
    assert main(["validate", str(path)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "RL, 1 served reward model (3 CPUs, 0 GPUs for all actors)" in text
