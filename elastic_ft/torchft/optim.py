"""TorchFT's ``OptimizerWrapper``: the optimizer steps only on a step every replica group commits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic_ft.replicas.manager import Manager


class OptimizerWrapper(torch.optim.Optimizer):
    """Wraps ``optim``: ``zero_grad()`` begins a step (the quorum), ``step()`` applies it only if the vote commits.

    ``zero_grad()`` must come before the forward pass and ``step()`` after the backward pass, as in TorchFT.
    """

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:  # no super().__init__: a view
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("OptimizerWrapper.step: closures are not supported (TorchFT's neither)")
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, Any]:  # type: ignore[override]
        return self.optim.state


#: TorchFT exports the wrapper under both names.
Optimizer = OptimizerWrapper
