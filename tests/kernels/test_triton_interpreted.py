"""The Triton head loss under the Triton interpreter (CPU) against the float64 reference.

TRITON_INTERPRET must be set before triton is first imported (its own library functions are
decorated then), so `test_triton_head_loss.py` runs this module in a fresh interpreter with
it set; in any other process this module skips.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "runs in a subprocess with TRITON_INTERPRET=1 (test_triton_head_loss.py)",
        allow_module_level=True,
    )
pytest.importorskip("triton")

import torch

from mtprun.compiler import HeadPlan
from mtprun.kernels import HeadInputs
from mtprun.kernels.row_groups import row_groups
from mtprun.kernels.triton import launch, rows, triton_head_loss
from mtprun.kernels.triton.select import select_policy_rows, selects_on_device

from .test_triton_cases import (
    PLANS,
    assert_matches_reference,
    assert_weight_grad_goes_into_main_grad,
    head_inputs,
    make_batch,
    run,
)

assert type(rows.head_rows_kernel).__name__ == "InterpretedFunction"

SHAPE = {"n": 32, "h": 16, "v": 300}
BLOCK_V = 128  # three vocab tiles, the last one partial
SEVEN_ROW_CHUNKS = 7 * SHAPE["v"] * 4 * 4  # teachers of MTP rows fall in the next chunk


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_V", BLOCK_V)


@pytest.mark.parametrize(
    ("name", "active"), [*((name, 0.6) for name in sorted(PLANS)), ("sft", 1.0)]
)
def test_matches_reference_float32(name: str, active: float) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    batch = make_batch(len(name) * 7 + int(active * 10), active, **SHAPE)
    assert_matches_reference(triton_head_loss, plan, batch, 2e-4, chunk_bytes=SEVEN_ROW_CHUNKS)


@pytest.mark.parametrize("name", ["sft", "grpo", "mtp_soft", "gspo_dual_clip_tis"])
def test_matches_reference_bfloat16(name: str) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    batch = make_batch(7, 0.5, dtype=torch.bfloat16, **SHAPE)
    assert_matches_reference(triton_head_loss, plan, batch, 3e-2)


def test_sparse_mask_and_uncompacted_rows_agree() -> None:
    batch = make_batch(11, 0.1, **SHAPE)
    for compact in (True, False):
        plan = HeadPlan.from_losses(PLANS["grpo"], compact_mask=compact)
        assert_matches_reference(triton_head_loss, plan, batch, 2e-4)


def test_all_masked_batch_gives_zero_loss_and_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["mtp_soft"])
    out, grads = run(triton_head_loss, plan, make_batch(3, 0.0, **SHAPE))
    assert float(out.loss.detach()) == 0.0
    assert all(float(m) == 0.0 for m in out.metrics.values())
    assert all(bool((g == 0).all()) for g in grads)
    assert bool((out.logprobs == 0).all())


def test_loss_scale_reaches_gradients() -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = make_batch(5, 0.7, **SHAPE)
    out = triton_head_loss(head_inputs(plan, batch))
    (3.0 * out.loss).backward()
    scaled = batch["hidden"].grad.clone()
    _, grads = run(triton_head_loss, plan, batch)
    torch.testing.assert_close(scaled, 3.0 * grads[0])


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_weight_gradient_goes_into_main_grad(name: str) -> None:
    plan = HeadPlan.from_losses(PLANS[name])
    assert_weight_grad_goes_into_main_grad(triton_head_loss, plan, make_batch(9, 0.6, **SHAPE))


def test_missing_advantages_is_rejected_with_the_argument_name() -> None:
    plan = HeadPlan.from_losses(PLANS["grpo"])
    batch = make_batch(1, 0.5, **SHAPE)
    with pytest.raises(ValueError, match="advantages"):
        HeadInputs.build(
            plan,
            batch["hidden"],
            batch["weight"],
            targets=batch["targets"],
            loss_mask=batch["loss_mask"],
        )


TP_PLANS = {
    "all_terms": [
        {"kind": "ce"},
        {"kind": "z_loss", "weight": 1e-2},
        {"kind": "grpo", "kl_coef": 0.1},
        {"kind": "mtp", "depth": 1, "target": "soft"},
    ],
    "gspo_dual_clip_tis": PLANS["gspo_dual_clip_tis"],
    "cispo_tis_sum_norm": PLANS["cispo_tis_sum_norm"],
}


TP_BATCH = {"seed": 21, "active": 0.7, "n": 24, "h": 16, "v": 256}


def _tp_rank(rank: int, init_file: str, batch: dict, results) -> None:
    """One rank of a 2-way vocab-parallel run of every TP_PLANS plan in turn (spawned; gloo on
    CPU): one pair of processes for all of them, as each spawn imports torch and triton."""
    import traceback

    import torch.distributed as dist

    from .interpreter_patching import install

    install()
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        try:
            shard = batch["weight"].shape[0] // 2
            batch = dict(
                batch,
                hidden=batch["hidden"].requires_grad_(),
                weight=batch["weight"][rank * shard : (rank + 1) * shard].requires_grad_(),
                mtp_hidden=[h.requires_grad_() for h in batch["mtp_hidden"]],
            )
            for name in sorted(TP_PLANS):
                plan = HeadPlan.from_losses(TP_PLANS[name], tp_size=2)
                out, grads = run(triton_head_loss, plan, batch, tp_group=dist.group.WORLD)
                metrics = {k: float(v) for k, v in out.metrics.items()}
                # numpy arrays travel by value (tensors would be shared memory of an exited
                # process)
                arrays = [t.numpy() for t in (out.logprobs, *grads)]
                results.put((name, rank, float(out.loss.detach()), metrics, arrays))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def vocab_parallel_ranks(tmp_path_factory) -> dict:
    """Each TP_PLANS plan's outputs of the two ranks, {name: [(rank, loss, metrics, arrays)]}
    sorted by rank."""
    import torch.multiprocessing as mp

    batch = make_batch(**TP_BATCH)
    shared = {
        k: [t.detach() for t in v] if isinstance(v, list) else v.detach() for k, v in batch.items()
    }
    init = str(tmp_path_factory.mktemp("vocab_parallel") / "init")
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_tp_rank, args=(r, init, shared, results)) for r in range(2)]
    for process in ranks:
        process.start()
    outputs: dict = {name: [] for name in TP_PLANS}
    try:
        for _ in range(2 * len(TP_PLANS)):
            name, *output = results.get(timeout=240)
            assert name != "error", f"rank {output[0]} failed:\n{output[1]}"
            outputs[name].append(tuple(output))
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0
    finally:
        for process in ranks:
            if process.is_alive():  # its peer failed: it waits in a collective
                process.kill()
    return {name: sorted(pair, key=lambda output: output[0]) for name, pair in outputs.items()}


@pytest.mark.parametrize("name", sorted(TP_PLANS))
def test_vocab_parallel_matches_one_process(vocab_parallel_ranks, name: str) -> None:
    batch = make_batch(**TP_BATCH)
    single, single_grads = run(triton_head_loss, HeadPlan.from_losses(TP_PLANS[name]), batch)
    outputs = vocab_parallel_ranks[name]
    assert [rank for rank, *_ in outputs] == [0, 1]
    for rank, loss, metrics, arrays in outputs:
        logprobs, *grads = (torch.from_numpy(a) for a in arrays)
        assert loss == pytest.approx(float(single.loss.detach()), rel=1e-5)
        for metric, value in metrics.items():
            expected = float(single.metrics[metric])
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-6), metric
        torch.testing.assert_close(logprobs, single.logprobs, rtol=1e-5, atol=1e-5)
        hidden_grad, weight_grad, *mtp_grad = grads
        torch.testing.assert_close(hidden_grad, single_grads[0], rtol=1e-4, atol=1e-6)
        for got, expected in zip(mtp_grad, single_grads[2:], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        shard = weight_grad.shape[0]
        expected = single_grads[1][rank * shard : (rank + 1) * shard]
        torch.testing.assert_close(weight_grad, expected, rtol=1e-4, atol=1e-6)


def test_second_backward_on_one_forward_is_refused() -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = make_batch(2, 0.5, **SHAPE)
    loss = triton_head_loss(head_inputs(plan, batch)).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_float32_teacher_for_a_bfloat16_student() -> None:
    plan = HeadPlan.from_losses(PLANS["distill"])
    batch = make_batch(3, 0.6, dtype=torch.bfloat16, **SHAPE)
    batch["teacher_hidden"] = batch["teacher_hidden"].float()
    batch["teacher_weight"] = batch["teacher_weight"].float()
    assert_matches_reference(triton_head_loss, plan, batch, 3e-2)


def _validated(plan: HeadPlan, batch: dict) -> HeadInputs:
    return head_inputs(plan, batch | {k: batch[k].detach() for k in ("hidden", "weight")})


@pytest.mark.parametrize(
    ("active", "leading"), [(0.0, 0), (0.03, 0), (0.5, 0), (0.5, 37), (0.97, 500), (1.0, 0)]
)
def test_device_row_selection_matches_row_groups(active: float, leading: int) -> None:
    """Several programs (16 rows each), many packed sequences, a hidden size over one tile;
    `leading` rows selected first (they keep their index and are not moved by the kernel)."""
    plan = HeadPlan.from_losses(PLANS["grpo"])
    batch = make_batch(int(active * 100) + 5, active, n=1000, h=300, v=50)
    batch["loss_mask"][:leading] = True
    batch["cu_seqlens"] = torch.tensor([0, 1, 2, 17, 300, 301, 640, 999, 1000])
    inputs = _validated(plan, batch)
    assert selects_on_device(plan, inputs)
    group, student = select_policy_rows(plan, inputs)
    (expected,) = row_groups(plan, inputs)
    for field in ("rows", "valid", "seq_ids", "targets"):
        assert torch.equal(getattr(group, field), getattr(expected, field)), field
    assert torch.equal(student, inputs.hidden[expected.rows])


def _poisoned(row_value: float, *, selected: bool) -> dict:
    batch = make_batch(9, 0.5, n=200, h=40, v=50)
    row = int(torch.nonzero(batch["loss_mask"] == selected)[3])
    with torch.no_grad():
        batch["hidden"][row, 37] = row_value
    return batch


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_device_row_selection_rejects_non_finite_selected_rows(value: float) -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    with pytest.raises(ValueError, match=r"hidden holds non-finite values .* 1 row"):
        select_policy_rows(plan, _validated(plan, _poisoned(value, selected=True)))


def test_device_row_selection_ignores_non_finite_masked_rows() -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = _poisoned(float("nan"), selected=False)
    group, _ = select_policy_rows(plan, _validated(plan, batch))
    assert group.num_rows == int(batch["loss_mask"].sum())


@pytest.mark.parametrize(
    ("field", "index", "value", "message"),
    [
        ("targets", 150, 50, r"targets must lie in \[0, 50\).*\[0, 50\]"),
        ("targets", 7, -1, r"targets must lie in \[0, 50\).*\[-1, "),
        ("cu_seqlens", 2, 20, "cu_seqlens must rise from 0 to N=200"),
        ("cu_seqlens", 3, 199, "cu_seqlens must rise from 0 to N=200"),
    ],
)
def test_device_row_selection_rejects_bad_values(field, index, value, message) -> None:
    plan = HeadPlan.from_losses(PLANS["sft"])
    batch = make_batch(4, 0.5, n=200, h=40, v=50)
    batch["cu_seqlens"] = torch.tensor([0, 30, 60, 200])
    batch[field][index] = value
    with pytest.raises(ValueError, match=message):
        select_policy_rows(plan, _validated(plan, batch))
