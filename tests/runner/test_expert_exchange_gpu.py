"""The overlapped expert-parallel exchange on two GPUs (NCCL's asynchronous all-to-alls on its
own stream, `torch._grouped_mm` experts in bf16) against megatron-core's dispatcher: the
check of `test_expert_exchange` with CUDA's streams in the way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from .test_expert_exchange import check_chunks_equal_the_dispatcher, exchange_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

LAYOUT = {"dp": 2, "ep": 2}


def _rank(rank: int, port: int, out: Path) -> None:
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    init_parallel(ParallelSection(**LAYOUT), rank, 2, "127.0.0.1", port)
    torch.save(exchange_job(rank, LAYOUT, "cuda", torch.bfloat16, (1, 2, 3)), out / f"{rank}.pt")
    destroy_parallel()


def test_overlapped_exchange_equals_the_dispatcher_on_two_gpus(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, (port, tmp_path), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    check_chunks_equal_the_dispatcher(ranks, rtol=2e-2, atol=2e-2)
