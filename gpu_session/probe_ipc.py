import torch
import torch.multiprocessing as mp
from mtprun.runner.cuda_ipc import SharedWeights, open_weights


def child(handles, want, q):
    got = [(n, t.cpu()) for n, t in open_weights(handles)]
    q.put([n for n, _ in got] == list(want) and all(torch.equal(t, want[n]) for n, t in got))


if __name__ == "__main__":
    g = torch.Generator(device="cuda").manual_seed(0)
    dts = [torch.bfloat16, torch.float32, torch.float16] * 4
    w = {f"t{i}": torch.randn(1000 + 37 * i, 64, device="cuda", generator=g).to(dt) for i, dt in enumerate(dts)}
    w["big"] = torch.randn(3000, 1000, device="cuda", generator=g)
    shared = SharedWeights(w, bucket_bytes=1 << 20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(shared.handles, {n: t.cpu() for n, t in w.items()}, q))
    p.start()
    assert q.get(timeout=120) is True
    p.join()
    print("ipc ok", len(shared.buckets), "buckets", shared.nbytes)
