"""Every schema error is reported as `file:line:col: message` at the key or value written."""

from __future__ import annotations

import pytest

# (recipe text appended to BASE, expected "line:col: message" lines). BASE has 9 lines.
CASES = {
    "unknown top-level key": (
        "lossses: []\n",
        ["10:1: unknown key 'lossses' (did you mean 'losses'?)"],
    ),
    "unknown nested key": (
        "trainer:\n  learning_rate: 0.1\n",
        ["11:3: unknown key 'learning_rate' in 'trainer'"],
    ),
    "misspelled nested key": (
        "trainer:\n  stpes: 3\n",
        ["11:3: unknown key 'stpes' in 'trainer' (did you mean 'steps'?)"],
    ),
    "unknown key inside a loss term": (
        "losses:\n  - kind: grpo\n    clip_lo: 0.1\n",
        ["12:5: unknown key 'clip_lo' in 'losses.0' (did you mean 'clip_low'?)"],
    ),
    "wrong type": (
        "trainer:\n  steps: ten\n",
        [
            "11:10: trainer.steps: input should be a valid integer, unable to parse string as "
            "an integer (got 'ten')"
        ],
    ),
    "out of range": (
        "trainer:\n  lr: -0.5\n",
        ["11:7: trainer.lr: input should be greater than 0 (got -0.5)"],
    ),
    "out of range in a loss term": (
        "losses:\n  - kind: ce\n  - kind: grpo\n    clip_low: 1.5\n",
        ["13:15: losses.1.clip_low: input should be less than 1 (got 1.5)"],
    ),
    "negative loss weight": (
        "losses:\n  - {kind: ce, weight: -1}\n",
        ["11:24: losses.0.weight: input should be greater than or equal to 0 (got -1)"],
    ),
    "clip_high must be positive": (
        "losses:\n  - kind: grpo\n    clip_high: 0\n",
        ["12:16: losses.0.clip_high: input should be greater than 0 (got 0)"],
    ),
    "literal with a close match": (
        "rollout:\n  engine: vlm\n",
        ["11:11: rollout.engine: invalid value 'vlm' (did you mean 'vllm'?); allowed: 'vllm'"],
    ),
    "unknown loss kind": (
        "losses:\n  - kind: focal\n",
        [
            "11:11: losses.0: unknown loss kind 'focal'; "
            "allowed: ce, z_loss, grpo, entropy, distill, mtp, router_aux, router_z"
        ],
    ),
    "misspelled loss kind": (
        "losses:\n  - {kind: zloss}\n",
        [
            "11:12: losses.0: unknown loss kind 'zloss' (did you mean 'z_loss'?); "
            "allowed: ce, z_loss, grpo, entropy, distill, mtp, router_aux, router_z"
        ],
    ),
    "loss term without kind": (
        "losses:\n  - weight: 1.0\n",
        [
            "11:5: losses.0: a loss term needs `kind:` "
            "(one of ce, z_loss, grpo, entropy, distill, mtp, router_aux, router_z)"
        ],
    ),
    "empty loss list": (
        "losses: []\n",
        ["10:1: losses: list should have at least 1 item after validation, not 0"],
    ),
    "bad mask name": (
        "mask: sampeld\n",
        [
            "10:7: mask: invalid value 'sampeld' (did you mean 'sampled'?); "
            "allowed: 'sampled', 'all', or a roles table such as {assistant: true, tool: false}"
        ],
    ),
    "bad mask role": (
        "mask:\n  assistant: true\n  tools: false\n",
        [
            "12:3: mask: invalid key 'tools' (did you mean 'tool'?); "
            "allowed: 'system', 'user', 'assistant', 'tool'"
        ],
    ),
    "mask role flag not a bool": (
        "mask: {assistant: maybe}\n",
        [
            "10:19: mask.assistant: input should be a valid boolean, unable to interpret "
            "input (got 'maybe')"
        ],
    ),
    "missing required key in a section": (
        "warmstart:\n  steps: 3\n  lr: 0.1\n",
        ["10:1: missing required key 'data' in 'warmstart'"],
    ),
    "model validator error points at its section": (
        "parallel: {tp: 1}\n",
        [],
    ),
    "topk target without k": (
        "losses:\n  - kind: ce\n  - kind: mtp\n    target: topk\n",
        ["12:5: losses.1: target 'topk' needs `topk: K` (for example topk: 20)"],
    ),
    "unknown policy loss": (
        "losses:\n  - {kind: ce, weight: 0.1}\n  - {kind: grpo, policy_loss: ppo}\n",
        ["12:31: losses.1.policy_loss: invalid value 'ppo'; allowed: 'clip', 'cispo'"],
    ),
    "dual clip bound not above 1": (
        "losses:\n  - {kind: ce, weight: 0.1}\n  - {kind: grpo, clip_c: 0.5}\n",
        ["12:26: losses.1.clip_c: input should be greater than 1 (got 0.5)"],
    ),
    "dual clip with cispo": (
        "losses:\n  - kind: ce\n  - kind: grpo\n    policy_loss: cispo\n    clip_c: 3\n",
        [
            "12:5: losses.1: `clip_c` (dual-clip) bounds PPO's clipped surrogate and has no "
            "effect with policy_loss 'cispo': remove clip_c or use policy_loss: clip"
        ],
    ),
    "cispo with a lower clip": (
        "losses:\n  - kind: ce\n  - {kind: grpo, policy_loss: cispo, clip_low: 0.1}\n",
        [
            "12:5: losses.1: policy_loss 'cispo' caps its IS weight at 1 + clip_high only: "
            "remove `clip_low` (it has no lower bound)"
        ],
    ),
    "tis cap below 1": (
        "losses:\n  - {kind: grpo, tis_cap: 0.5}\n",
        ["11:27: losses.0.tis_cap: input should be greater than or equal to 1 (got 0.5)"],
    ),
    "unknown ratio level": (
        "losses:\n  - {kind: grpo, ratio: seq}\n",
        ["11:25: losses.0.ratio: invalid value 'seq'; allowed: 'token', 'sequence'"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_is_located_at_what_was_written(
    write_recipe, located, base_recipe, case: str
) -> None:
    extra, expected = CASES[case]
    path = write_recipe(base_recipe + extra)
    assert located(path) == [f"{path}:{line}" for line in expected]


def test_an_unknown_renderer_is_located_at_its_value_with_the_known_ones(
    write_recipe, located, base_recipe
) -> None:
    path = write_recipe(base_recipe + "task:\n  name: arithmetic\n  renderer: qwen9\n")
    (error,) = located(path)
    assert error.startswith(f"{path}:12:13: task.renderer: unknown renderer 'qwen9'; known: ")
    assert "auto, none," in error and "qwen3," in error and "glm-4.5," in error


def test_missing_top_level_key_points_at_the_file_start(write_recipe, located) -> None:
    path = write_recipe("model:\n  tiny: {}\ndata: {source: arithmetic}\n")
    assert located(path) == [f"{path}:1:1: missing required key 'name'"]


def test_model_path_and_tiny_together(write_recipe, located, base_recipe) -> None:
    path = write_recipe(base_recipe.replace("model:\n", "model:\n  path: /m\n"))
    assert located(path) == [
        f"{path}:2:1: model: set exactly one of `path` (an HF model folder) and `tiny`"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: [t\nmodel: {}\n", "2:6: YAML syntax error: expected ',' or ']', but got ':'"),
        ("name: t\n  model: 1\n", "2:8: YAML syntax error: mapping values are not allowed here"),
        (
            "name: t\nname: u\n",
            '2:1: YAML syntax error: found duplicate key "name" with value "u" '
            '(original value: "t")',
        ),
        (
            "name: !!python/object:os.system t\n",
            "1:7: YAML tag 'tag:yaml.org,2002:python/object:os.system' is not allowed: "
            "recipes are plain data (remove the tag)",
        ),
        ("- name: t\n", "1:1: a recipe is a mapping of sections (name:, model:, ...)"),
    ],
)
def test_yaml_problems_are_located(write_recipe, located, text: str, expected: str) -> None:
    path = write_recipe(text)
    assert located(path) == [f"{path}:{expected}"]


def test_unreadable_file(tmp_path, located) -> None:
    missing = tmp_path / "nope.yaml"
    assert located(missing) == [f"{missing}:1:1: cannot read: No such file or directory"]


def test_run_name_must_be_a_folder_name(write_recipe, located, base_recipe) -> None:
    path = write_recipe(base_recipe.replace("name: t", "name: my run/1"))
    assert located(path) == [
        f"{path}:1:7: name: 'my run/1' is not a run name: use letters, digits, '.', '_', '-'"
    ]


def test_merge_keys_point_at_the_merged_mapping(write_recipe, located, base_recipe) -> None:
    extra = "losses:\n  - &ce {kind: ce, weight: -1}\n  - {<<: *ce, kind: z_loss}\n"
    path = write_recipe(base_recipe + extra)
    message = "input should be greater than or equal to 0 (got -1)"
    assert located(path) == [
        f"{path}:11:28: losses.0.weight: {message}",
        f"{path}:11:28: losses.1.weight: {message}",
    ]


def test_alias_bombs_are_refused(write_recipe, located) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    path = write_recipe("\n".join(levels) + "\n")
    assert located(path) == [
        f"{path}:1:1: the recipe expands to more than 100000 values (nested YAML aliases?)"
    ]
