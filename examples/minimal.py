import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_ft import CallWrapper, Wrapper

STEPS, GLOBAL_BATCH = 3000, 48  # 48: the same global batch on 4, 3, 2 or 1 ranks
torch.manual_seed(0)  # the training state lives outside the wrapped function: a restart keeps it
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
features = torch.randn(8192, 16)
data = TensorDataset(features, features.sum(dim=1, keepdim=True))


def state_dict():
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load_state_dict(state):  # a rank that comes back behind receives a live peer's state
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


@Wrapper(state_dict=state_dict, load_state_dict=load_state_dict)
def train(call_wrapper: CallWrapper | None = None):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set anew for each call
    dist.init_process_group("gloo", store=call_wrapper.process_group_store(), rank=rank, world_size=world_size)
    try:
        ddp = DistributedDataParallel(model)
        while call_wrapper.step < STEPS:  # optimizer steps taken; a restart never cuts one
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=call_wrapper.step)
            for x, y in DataLoader(data, batch_size=GLOBAL_BATCH // world_size, sampler=sampler):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
                if call_wrapper.step >= STEPS:
                    break
        return call_wrapper.step
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(f"rank {os.environ['RANK']} finished at step {train()}")
