"""The packages expose State, Mode and Compose at top level, as NVIDIA's inprocess package does."""

from __future__ import annotations

import elastic_ft
import elastic_ft.inprocess.compose
import elastic_ft.inprocess.rank_assignment
import elastic_ft.inprocess.state


def test_package_reexports_state_mode_and_compose() -> None:
    for package in (elastic_ft, elastic_ft.inprocess):
        assert package.State is elastic_ft.inprocess.state.State
        assert package.Mode is elastic_ft.inprocess.state.Mode
        assert package.Compose is elastic_ft.inprocess.compose.Compose
    assert elastic_ft.rank_assignment is elastic_ft.inprocess.rank_assignment


def test_rank_assignment_module_exports_the_public_names() -> None:
    expected = {
        "RankAssignment",
        "RankAssignmentCtx",
        "RankDiscarded",
        "Tree",
        "Layer",
        "LayerFlag",
        "FillGaps",
        "ShiftRanks",
        "FilterCountGroupedByKey",
        "RankFilter",
        "ActivateAllRanks",
        "ActiveWorldSizeDivisibleBy",
        "MaxActiveWorldSize",
    }
    assert expected <= set(elastic_ft.rank_assignment.__all__)
    assert all(hasattr(elastic_ft.rank_assignment, name) for name in elastic_ft.rank_assignment.__all__)
