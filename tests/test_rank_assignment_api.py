"""The package exposes State, Mode and Compose at top level, as NVIDIA's inprocess package does."""

from __future__ import annotations

import elastic_ft
import elastic_ft.compose
import elastic_ft.rank_assignment
import elastic_ft.state


def test_package_reexports_state_mode_and_compose() -> None:
    assert elastic_ft.State is elastic_ft.state.State
    assert elastic_ft.Mode is elastic_ft.state.Mode
    assert elastic_ft.Compose is elastic_ft.compose.Compose


def test_rank_assignment_module_exports_the_public_names() -> None:
    expected = {
        "RankAssignment", "RankAssignmentCtx", "RankDiscarded", "Tree", "Layer", "LayerFlag", "FillGaps",
        "ShiftRanks", "FilterCountGroupedByKey", "RankFilter", "ActivateAllRanks", "ActiveWorldSizeDivisibleBy",
        "MaxActiveWorldSize",
    }  # fmt: skip
    assert expected <= set(elastic_ft.rank_assignment.__all__)
    assert all(hasattr(elastic_ft.rank_assignment, name) for name in elastic_ft.rank_assignment.__all__)
