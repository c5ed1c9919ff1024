"""Weights from trainer rank 0 to the rollout engines over a collective: both ends of it.

The transfer group is a process group of its own (gloo on CPU, NCCL on GPUs) built straight
from a TCP store that trainer rank 0 hosts: member 0 is trainer rank 0, member 1 + i is
engine i. It touches neither the trainer's default group nor the one vLLM makes inside the
engine process. Its membership is fixed when it forms, so a restarted engine (or trainer)
means a new group: each formation is a `generation` with its own key prefix in the one store.

One send is a few parts (a weight sync's: a few decoder layers each), each a JSON header
(names, dtypes, shapes: the engines need no layout beforehand) then the tensors' bytes packed
back to back into buckets of at most `BUCKET_BYTES`, each one broadcast; a final header ends
it. Bytes, not typed tensors: every dtype travels (gloo has no bfloat16 reduction types, a
broadcast needs none) and arrives bit for bit. Neither end holds the whole model at once:
the sender gathers a part as it sends it, a receiver takes the buckets one at a time as it
loads their tensors (a split engine keeps only 1 - SPLIT_GPU_MEMORY_UTILIZATION of its GPU
outside vLLM's pools).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import groupby
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # bounds the sender's and the receiver's staging buffers
_ALIGN = 16  # each tensor starts at a multiple of this many bytes, so its typed view is legal
_TIMEOUT = timedelta(minutes=10)  # a member that never answers fails the send instead of hanging
# Every member is asked to join at the same moment, so a (gloo) formation is over in
# milliseconds; one still waiting after this has a member that died on the way (an engine
# killed while it joined), and fails, so that the run can restart that engine and form the
# next generation.
FORM_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in the packed stream: bucket, byte offset and its metadata."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def plan_buckets(
    layout: list[tuple[str, str, list[int]]], bucket_bytes: int = BUCKET_BYTES
) -> tuple[list[TensorSlot], list[int]]:
    """Slots for (name, dtype, shape) in order and the byte size of each bucket. A tensor
    larger than a bucket gets a bucket of its own."""
    slots: list[TensorSlot] = []
    sizes: list[int] = [0]
    for name, dtype_text, shape in layout:
        dtype = getattr(torch, dtype_text)
        nbytes = _numel(shape) * dtype.itemsize
        offset = _aligned(sizes[-1])
        if sizes[-1] > 0 and offset + nbytes > bucket_bytes:
            sizes.append(0)
            offset = 0
        slots.append(TensorSlot(name, dtype, tuple(shape), len(sizes) - 1, offset))
        sizes[-1] = offset + nbytes
    return slots, sizes


def unpack_buckets(
    buckets: list[torch.Tensor], slots: list[TensorSlot]
) -> list[tuple[str, torch.Tensor]]:
    """(name, typed view into its bucket) for every slot, in order: no copies."""
    return [(slot.name, _view(buckets[slot.bucket], slot)) for slot in slots]


def _view(bucket: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return bucket[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


class TransferGroup:
    """This process's membership of one generation of the transfer group."""

    def __init__(
        self,
        store: dist.Store,
        generation: int,
        rank: int,
        world_size: int,
        form_timeout: timedelta = FORM_TIMEOUT,
    ) -> None:
        """gloo: returns once every member joined, raises after `form_timeout` when one did
        not (gloo bounds its rendezvous by the group's timeout; each broadcast sets its own).
        NCCL connects at the first broadcast, which `_TIMEOUT` bounds."""
        prefixed = dist.PrefixStore(f"mtprun-weights/{generation}", store)
        self.device = torch.device("cuda", torch.cuda.current_device()) if _cuda() else None
        if self.device is None:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, form_timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _TIMEOUT
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)

    @classmethod
    def join(
        cls, host: str, port: int, generation: int, rank: int, world_size: int
    ) -> TransferGroup:
        """Member `rank` (1..) joins through the store trainer rank 0 hosts at host:port."""
        store = dist.TCPStore(host, port, is_master=False, timeout=_TIMEOUT)
        return cls(store, generation, rank, world_size)

    def send(self, weights: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> int:
        """Broadcast `weights` from member 0; returns the bytes sent to each member."""
        return self.send_parts([weights], bucket_bytes)

    def send_parts(
        self, parts: Iterable[dict[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
    ) -> int:
        """Broadcast the tensors of each of `parts` from member 0, one part at a time (its
        header, then its buckets), so that member 0 needs only the part at hand; the members
        receive them as one stream (`receive`). Returns the bytes sent to each member."""
        sent, last = 0, None
        for part in parts:
            layout = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in part.items()]
            self._send_header(layout, bucket_bytes, final=False)
            slots, sizes = plan_buckets(layout, bucket_bytes)
            held = slots_by_bucket(slots)
            device = self.device or _device_of(part)
            for bucket, size in enumerate(sizes):
                last = self._broadcast(pack_bucket(part, held.get(bucket, []), size, device))
            sent += sum(sizes)
            del part  # before the next part is gathered
        if last is not None:
            _wait_done(last, "the weight broadcast to the rollout engines")
        self._send_header([], bucket_bytes, final=True)
        return sent

    def _send_header(self, layout: list, bucket_bytes: int, final: bool) -> None:
        header = {"layout": layout, "bucket_bytes": bucket_bytes, "final": final}
        self._broadcast_bytes(json.dumps(header).encode())

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors member 0 sends, in its order, as views into their buckets. The first
        header arrives now; each bucket when the iteration reaches it, so a caller that loads
        the tensors as they come holds one bucket (and what it keeps of it), not the whole
        payload. Iterate to the end: member 0's send completes only once every member has
        received every part."""
        return self._parts(json.loads(self._broadcast_bytes(None).decode()))

    def _parts(self, header: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        while not header["final"]:
            yield from self._buckets(*plan_buckets(header["layout"], header["bucket_bytes"]))
            header = json.loads(self._broadcast_bytes(None).decode())

    def _buckets(
        self, slots: list[TensorSlot], sizes: list[int]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        device = self.device or torch.device("cpu")
        held = slots_by_bucket(slots)
        for bucket, size in enumerate(sizes):
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            self._broadcast(flat)
            yield from ((slot.name, _view(flat, slot)) for slot in held.get(bucket, ()))
            del flat  # before the next bucket's allocation: the caller holds what it kept

    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        """A byte string from member 0 (payload there, None elsewhere): length, then bytes."""
        device = self.device or torch.device("cpu")
        length = torch.tensor([len(payload) if payload is not None else 0], device=device)
        self._broadcast(length)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        if payload is not None:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(data)
        return bytes(data.cpu().numpy())

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        # Receivers wait in the header's broadcast while rank 0 gathers the weights: far
        # longer than a formation may take.
        options = dist.BroadcastOptions()
        options.timeout = _TIMEOUT
        work = self.group.broadcast([tensor], options)
        work.wait()  # NCCL: the current stream waits for it; gloo: done on return
        return work


class TransferHost:
    """Trainer rank 0's side: the store every generation rendezvouses in (one per process,
    on a free port), and its current membership."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_TIMEOUT
        )
        self.group: TransferGroup | None = None

    def form(
        self, generation: int, world_size: int, form_timeout: timedelta = FORM_TIMEOUT
    ) -> None:
        """Form `generation` as member 0; returns when every member joined it, raises after
        `form_timeout` when one did not (the next generation may then form)."""
        self.group = None  # the previous generation's connections go first
        self.group = TransferGroup(self.store, generation, 0, world_size, form_timeout)


def slots_by_bucket(slots: list[TensorSlot]) -> dict[int, list[TensorSlot]]:
    """The slots (`plan_buckets`' order) of each bucket."""
    return {bucket: list(group) for bucket, group in groupby(slots, attrgetter("bucket"))}


def _device_of(part: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(part.values())).device if part else torch.device("cpu")


def pack_bucket(
    part: dict[str, torch.Tensor], slots: list[TensorSlot], size: int, device: torch.device
) -> torch.Tensor:
    """One bucket (`size` bytes on `device`) of `part`: the bytes of its `slots`' tensors at
    their offsets (a transfer's buckets and CUDA IPC's)."""
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    for slot in slots:
        source = part[slot.name].detach().contiguous().reshape(-1)
        flat[slot.offset : slot.offset + slot.nbytes].copy_(source.view(torch.uint8))
    return flat


def _wait_done(work: dist.Work, what: str, timeout: timedelta = _TIMEOUT) -> None:
    """Block until `work` completed on its device, or raise after `timeout`. The sender waits
    for its last broadcast so that a transfer that never completes (a receiver gone, a broken
    NCCL transport) fails here, named, instead of stalling the trainer's next step on its
    stream (NCCL's `wait` returns at once: only the stream waits)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete in {timeout.total_seconds():.0f} s")
        time.sleep(0.001)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cuda() -> bool:
    return torch.cuda.is_available()


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
