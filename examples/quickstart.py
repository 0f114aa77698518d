"""Quickstart: a DDP training script with torch.optim, made fault tolerant by elastic_ft.Wrapper.

ftrun --nproc-per-node=4 examples/quickstart.py --checkpoint /tmp/quickstart.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_ft import CallWrapper, Wrapper

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--global-batch", type=int, default=64)
args = parser.parse_args()

# The training state lives outside the wrapped function: it survives restarts.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
progress = {"step": 0}
optimizer.register_step_post_hook(lambda *_: progress.update(step=progress["step"] + 1))
inputs = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


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
        ddp = DistributedDataParallel(model)
        batch = args.global_batch // world_size  # keep the global batch, so the learning rate stays right
        batches_per_epoch = len(data) // args.global_batch
        while progress["step"] < args.epochs * batches_per_epoch:
            epoch, done = divmod(progress["step"], batches_per_epoch)
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=epoch)
            loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
            for step_in_epoch, (x, y) in enumerate(loader):
                if step_in_epoch < done:
                    continue  # batches this epoch already trained on
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()  # a restart never cuts an optimizer step
                if progress["step"] % 20 == 0 and rank == 0:
                    with call_wrapper.atomic():  # nor a checkpoint write
                        torch.save(state_dict(), args.checkpoint + ".tmp")
                        os.replace(args.checkpoint + ".tmp", args.checkpoint)
                    print(f"step {progress['step']}: loss {loss.item():.4f} on {world_size} ranks", flush=True)
        return progress["step"]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(f"rank {os.environ['RANK']} finished at step {train()}")
