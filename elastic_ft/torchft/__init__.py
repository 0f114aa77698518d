"""TorchFT's names over elastic-ft's replica groups: a TorchFT script changes its imports and drops the Lighthouse.

``from torchft import Manager, DistributedDataParallel, Optimizer, ProcessGroupGloo`` becomes
``from elastic_ft.torchft import ...``; the replica groups meet in etcd instead of at a Lighthouse
(:mod:`elastic_ft.replicas`), and ``docs/migration.md`` lists what else differs.
"""

from elastic_ft.replicas.manager import Manager
from elastic_ft.replicas.process_group import ProcessGroupGloo
from elastic_ft.torchft.data import DistributedSampler
from elastic_ft.torchft.ddp import DistributedDataParallel
from elastic_ft.torchft.optim import Optimizer, OptimizerWrapper

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupGloo",
]
