"""Recipe -> HeadPlan: terms, tensor parallelism, JSON round trip, cost estimate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.compiler.estimate import estimate_head_cost, padded_vocab
from mtprun.losses.stats import Stat
from mtprun.spec import Recipe

MIMO = {"tiny": {"architecture": "mimo", "mtp_layers": 2, "heads": 2, "kv_heads": 2}}


def _recipe(losses: list[dict], tp: int = 1) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "c",
            "model": MIMO,
            "data": {"source": "arithmetic"},
            "losses": losses,
            "parallel": {"tp": tp},
        }
    )


def test_compile_recipe_takes_terms_and_tensor_parallel_size() -> None:
    plan = compile_recipe(_recipe([{"kind": "ce"}, {"kind": "mtp", "depth": 2}], tp=2))
    assert [t.kind for t in plan.terms] == ["ce", "mtp"]
    assert plan.tp_size == 2
    assert plan.mtp_depths == (1, 2)
    assert Stat.TEACHER_LSE in plan.stats and Stat.TARGET_LOGIT in plan.stats
    assert plan.metrics[0] == "entropy"


_TERMS = st.sampled_from(
    [
        {"kind": "ce", "weight": 0.7},
        {"kind": "z_loss"},
        {"kind": "entropy", "coef": 0.01},
        {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k2", "loss_agg": "seq-mean-token-mean"},
        {"kind": "distill", "teacher": "/t", "temperature": 2.0},
        {"kind": "mtp", "depth": 2, "target": "topk", "topk": 4},
        {"kind": "mtp", "depth": 1, "target": "hard"},
    ]
)


@settings(max_examples=40, deadline=None)
@given(terms=st.lists(_TERMS, min_size=1, max_size=4), tp=st.sampled_from([1, 2, 4]))
def test_plan_json_round_trip(terms: list[dict], tp: int) -> None:
    plan = HeadPlan.from_losses(terms, tp_size=tp)
    again = HeadPlan.from_json(plan.to_json())
    assert again == plan
    assert again.hash == plan.hash


def test_plan_hash_changes_with_any_coefficient() -> None:
    a = HeadPlan.from_losses([{"kind": "ce"}, {"kind": "z_loss", "weight": 1e-4}])
    b = HeadPlan.from_losses([{"kind": "ce"}, {"kind": "z_loss", "weight": 2e-4}])
    assert a.hash != b.hash


def test_padded_vocab_is_the_next_multiple_of_tp() -> None:
    assert [padded_vocab(105, tp) for tp in (1, 2, 4, 8)] == [105, 106, 108, 112]


def test_head_cost_by_hand() -> None:
    # ce only, tp 1: stats lse, target_logit, expected_logit (entropy is always reported).
    plan = HeadPlan.from_losses([{"kind": "ce"}])
    cost = estimate_head_cost(plan, rows=10, hidden=8, vocab=100, param_bytes=2, vocab_tile=64)
    assert cost.fused_bytes == 10 * 64 * 4 * 2 + 10 * 3 * 4
    assert cost.unfused_bytes == 10 * 100 * (2 + 4) + 1 * 10 * 100 * 4
    assert (cost.fused_collectives, cost.unfused_collectives) == (0, 0)
    assert cost.vocab_passes == 1


def test_head_cost_under_tensor_parallelism_with_mtp_heads() -> None:
    plan = HeadPlan.from_losses(
        [{"kind": "grpo"}, {"kind": "mtp", "depth": 2, "target": "topk", "topk": 3}],
        tp_size=2,
    )
    cost = estimate_head_cost(plan, rows=4, hidden=8, vocab=101, param_bytes=4)
    shard = 51  # 101 padded to 102, split over 2 ranks
    rows = 4 * 3  # policy rows and one row set per MTP head
    assert cost.padded_vocab == 102
    assert cost.fused_bytes == rows * shard * 4 * 2 + rows * (len(plan.stats) + 2 * 3) * 4
    assert cost.unfused_bytes == 4 * shard * 8 + (1 + 3 * 2) * 4 * shard * 4
    assert cost.fused_collectives == 2  # statistics exchange + top-k merge
    assert cost.unfused_collectives == 3 + 5 * 2
