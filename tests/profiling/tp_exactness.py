"""Run as a script (spawns 2 gloo processes): a TP2 block over gloo computes what the TP1 block computes.

Exit status 0 when the forward output and the input gradient of every block match on both ranks.
Used by test_tensor_parallel.py; a script because spawned children must import the worker.
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.profiling.replica import Replica
from lorafleet.specs.model import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny-llama"]


def block_outputs(replica: Replica) -> tuple[torch.Tensor, torch.Tensor]:
    batch = replica.batch(MicroBatchShape.padded(2, 24), torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 24, TINY.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rotary = replica.causal_lm.model.rotary_emb(hidden, batch.position_ids)
    out = replica.run_blocks(hidden, rotary, batch, range(TINY.n_layers))
    out.backward(torch.ones_like(out))
    return out.detach(), hidden.grad


def worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    adapters = AdapterLoad.uniform(2, 4)
    reference = block_outputs(Replica(TINY, adapters))
    sharded = block_outputs(Replica(TINY, adapters, tp=2, rank=rank, group=dist.group.WORLD))
    for want, got in zip(reference, sharded):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(worker, args=(free_port,), nprocs=2, start_method="spawn")
    sys.exit(0)
