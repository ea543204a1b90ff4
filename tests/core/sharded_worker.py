"""One rank of a 2-process CPU trainer (gloo) that publishes through ShardedPublisher; started by
test_sharded.py with torchrun. Modes: ``fsdp2`` (fully_shard: every rank holds dim-0 shards) and
``ddp`` (DistributedDataParallel: every rank holds the whole model). After each optimizer step it
publishes, and rank 0 saves the gathered full bf16 bits of that version for the test to compare.

Mode ``fail``: FSDP2, and rank 0's bucket fails from version 1 on; every rank writes the error
it got to ``OUT/rank<r>.err`` (none may hang in a collective).

Usage: torchrun --standalone --nproc_per_node 2 sharded_worker.py MODE BUCKET OUT STEPS
"""

import gc
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deltasync.bf16 import to_bf16_bits
from deltasync.publisher import PublisherConfig
from deltasync.sharded import ShardedPublisher


def main() -> None:
    mode, bucket, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # rows not divisible by 2 (5, 37): uneven shards; the embedding's rows change sparsely
    model = nn.Sequential(nn.Embedding(37, 16), nn.Linear(16, 5), nn.Linear(5, 37))
    if mode in ("fsdp2", "fail"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = model
    else:
        model = nn.parallel.DistributedDataParallel(model)
        params = model.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = PublisherConfig(
        anchor_every=3, keep_anchors=100, anchor_replay_fraction=1e9, encode_threads=1
    )
    pub = ShardedPublisher(bucket, "sharded", cfg)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    for step in range(steps + 1):
        if step:
            x = torch.randint(0, 37, (8, 4), generator=g)
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 37), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        named = list(params.named_parameters())
        try:
            version = pub.publish(named, step=step)
        except Exception as e:  # mode fail: every rank must get here, none may hang
            with open(f"{out}/rank{rank}.err", "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            break
        full = {}
        for name, p in named:  # the truth, gathered on every rank (a collective)
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            full[name] = to_bf16_bits(whole).copy()
        if rank == 0:
            np.savez(f"{out}/v{version}.npz", **full)
        if mode != "fail" or step == 0:
            pub.flush()
        if mode == "fail" and rank == 0 and step == 0:  # the bucket breaks after v0

            def broken(entry):
                raise OSError(f"bucket unreachable at v{entry.version}")

            pub.publisher.before_commit = broken
        elif mode == "fail" and rank == 0:
            # wait until v1's commit has failed on the publisher's thread: flush returns when it
            # has (raising its error); the next publish() raises it again, to every rank
            try:
                pub.flush(timeout=120)
            except OSError as e:
                assert str(e) == "bucket unreachable at v1", e
            else:
                raise AssertionError("v1 committed through a bucket that fails every commit")
    if mode != "fail":
        pub.close()
    # DDP's reducer holds gloo work objects; drop them while the interpreter is whole (torch 2.13
    # CPU aborted rank 1 once in CI at exit with "terminate called without an active exception",
    # the teardown race of pytorch/pytorch#190489 and the abandoned #179291)
    del model, opt, params
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the outcome is in OUT's files; skip the interpreter's finalisation, where gloo's worker
    # threads can still release tensors after the GIL is gone (the same race)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
