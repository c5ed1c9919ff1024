"""GPU benchmark: what trainer rank 0 holds and how long it takes to send a weight sync, the
whole model gathered at once (as before 2026-11-29) against the stream of parts the sync
sends now (`whole_model_chunks`, `TransferGroup.send_parts`); and the same for a colocated
sync through CUDA IPC (the whole model packed into buckets as `cuda_ipc.SharedWeights` packs
it, against one part at a time packed, copied by the engine and freed).

    python bench/sync_memory_gpu.py --shape qwen3-8b
    python bench/sync_memory_gpu.py --shape 1.5b --json bench/logs/sync_memory.json

One process on one GPU: the shape's random-init bf16 folder loaded as the policy (Megatron-core,
tp = 1; no optimizer), and a transfer group of rank 0 alone (NCCL, no engine: every bucket is
packed and broadcast as for one). The colocated engine's side is its copy of each part (a
clone of the part's buckets, as `RolloutEngine.load_ipc_part` takes it), on the same GPU as in
a colocated run. Each way runs --repeats times after a warm-up; printed: the peak GPU memory
above the model's own during a send, and the send's median seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from trainer_gpu import SHAPES, model_folder

from mtprun.models import ModelShape, megatron_to_hf
from mtprun.models.pp_layout import PipelineStage
from mtprun.runner.cuda_ipc import pack_weights
from mtprun.runner.net import free_port
from mtprun.runner.trainer.model import load_policy_model
from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
from mtprun.runner.trainer.whole_model import gather_whole_model, model_tensors, whole_model_chunks
from mtprun.runner.weight_transfer import TransferHost
from mtprun.spec.parallel import ParallelSection

GIB = 1 << 30


def _timed_peak(send: Callable[[], int]) -> tuple[float, float, int]:
    """(seconds, peak GiB above what is allocated now, bytes sent) of one `send()`."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    sent = send()
    torch.cuda.synchronize()
    return time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / GIB, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--layers", type=int, help="Decoder layers instead of the shape's.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, help="Where the random-init folder is kept.")
    parser.add_argument("--json", type=Path, help="Write the rows here too.")
    args = parser.parse_args()
    shape_spec = SHAPES[args.shape]
    if args.layers:
        shape_spec = replace(
            shape_spec, layers=args.layers, name=f"{shape_spec.name}-{args.layers}l"
        )
    root = args.model_dir or Path(tempfile.mkdtemp(prefix="syncmem"))
    folder = model_folder(shape_spec, 4096, root, "bfloat16", "cuda")
    init_parallel(ParallelSection(), 0, 1, "127.0.0.1", free_port())
    try:
        rows = _measure(folder, args.repeats)
    finally:
        destroy_parallel()
    for row in rows:
        print(json.dumps({"shape": shape_spec.name, **row}))
    if args.json:
        args.json.write_text(json.dumps([{"shape": shape_spec.name, **r} for r in rows], indent=1))


def _send(host: TransferHost, payload: Callable[[], Iterable[dict]]) -> int:
    return host.group.send_parts(payload())


# The colocated ways pack as `cuda_ipc.SharedWeights` does, without its IPC export: with no
# engine process to open and close the handles, torch would keep every exported bucket
# allocated (in its IPC limbo) past its release.


def _share_whole(payload: Callable[[], Iterable[dict]]) -> int:
    """The colocated sync before parts: the whole model packed, the engine reading the
    buckets in place."""
    (weights,) = payload()
    _, buckets = pack_weights(weights)
    del weights
    return sum(b.numel() for b in buckets)


def _share_parts(payload: Callable[[], Iterable[dict]]) -> int:
    """A part packed, the engine's copy of it taken, the part freed; then the next."""
    sent = 0
    for part in payload():
        _, buckets = pack_weights(part)
        del part
        engine_copy = [bucket.clone() for bucket in buckets]
        sent += sum(b.numel() for b in buckets)
        del engine_copy, buckets
    return sent


def _measure(folder: Path, repeats: int) -> list[dict]:
    shape = ModelShape.from_model_dir(folder)
    model = load_policy_model(folder, shape, torch.device("cuda"), 0, 1, dtype=torch.bfloat16)
    model_gib = torch.cuda.memory_allocated() / GIB
    stage = PipelineStage(0, 1, shape.layers)
    host = TransferHost("127.0.0.1", free_port())
    host.form(generation=1, world_size=1)
    convert = partial(megatron_to_hf, shape=shape)

    def whole() -> Iterable[dict]:
        return [convert(gather_whole_model(model_tensors(model), shape, stage, True))]

    def parts() -> Iterable[dict]:
        return whole_model_chunks(model_tensors(model), shape, stage, True, convert)

    rows = []
    ways = {
        "whole model": partial(_send, host, whole),
        "parts": partial(_send, host, parts),
        "cuda_ipc whole model": partial(_share_whole, whole),
        "cuda_ipc parts": partial(_share_parts, parts),
    }
    for name, send in ways.items():
        _timed_peak(send)  # warm-up
        runs = [_timed_peak(send) for _ in range(repeats)]
        rows.append({
            "send": name, "model_gib": round(model_gib, 2),
            "seconds": round(statistics.median(r[0] for r in runs), 3),
            "peak_gib_above_model": round(max(r[1] for r in runs), 2),
            "sent_gib": round(runs[0][2] / GIB, 2),
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
