"""Quickstart: a DDP training script with torch.optim, made fault tolerant by elastic_ft.Wrapper.

ftrun --nproc-per-node=4 examples/quickstart.py --checkpoint /tmp/quickstart.pt
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler, TensorDataset

from elastic_ft import CallWrapper, Wrapper

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--step-time", type=float, default=0.05, help="seconds a step takes at least (a GPU's share)")
args = parser.parse_args()

# The training state lives outside the wrapped function: it survives restarts.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
progress = {"step": 0}
optimizer.register_step_post_hook(lambda *_: progress.update(step=progress["step"] + 1))
inputs = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
steps_per_epoch = len(data) // args.global_batch
total_steps = args.epochs * steps_per_epoch


class ShareOfEachStep(Sampler):
    """This rank's share of each step's global batch, from step ``start`` on: every step trains on the same
    samples whatever the number of ranks (shares differ by one sample at most)."""

    def __init__(self, start: int, rank: int, world_size: int) -> None:
        self.start, self.rank, self.world_size = start, rank, world_size

    def __iter__(self):
        for step in range(self.start, total_steps):
            epoch, index = divmod(step, steps_per_epoch)
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
            batch = order[index * args.global_batch : (index + 1) * args.global_batch]
            yield batch.tensor_split(self.world_size)[self.rank].tolist()

    def __len__(self) -> int:
        return total_steps - self.start


def state_dict():
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": dict(progress)}


def load_state_dict(state):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    progress.update(state["progress"])


@Wrapper(state_dict=state_dict, load_state_dict=load_state_dict)
def train(call_wrapper: CallWrapper | None = None):
    # RANK and WORLD_SIZE are set for each call: after a fault the world may be smaller.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=call_wrapper.process_group_store(), rank=rank, world_size=world_size)
    try:
        if call_wrapper.iteration == 0 and os.path.exists(args.checkpoint):
            load_state_dict(torch.load(args.checkpoint))  # a (re)started process; later calls heal from peers
            if rank == 0 and progress["step"] >= total_steps:
                print(f"{args.checkpoint} is at step {progress['step']}, the end: delete it to train again")
        ddp = DistributedDataParallel(model)
        loader = DataLoader(data, batch_sampler=ShareOfEachStep(progress["step"], rank, world_size))
        for x, y in loader:
            started = time.monotonic()
            # The sum over this rank's share, over the global batch, times the ranks DDP averages over: the mean
            # over the global batch, exactly, on any number of ranks.
            loss = torch.nn.functional.mse_loss(ddp(x), y, reduction="sum") * world_size / args.global_batch
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # a restart never cuts an optimizer step
            if progress["step"] % 20 == 0 and rank == 0:
                with call_wrapper.atomic():  # nor a checkpoint write
                    torch.save(state_dict(), args.checkpoint + ".tmp")
                    os.replace(args.checkpoint + ".tmp", args.checkpoint)
                print(f"step {progress['step']}: loss {loss.item():.4f} on {world_size} ranks", flush=True)
            time.sleep(max(0.0, args.step_time - (time.monotonic() - started)))
        return progress["step"]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(f"rank {os.environ['RANK']} finished at step {train()}")
