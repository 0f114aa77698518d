"""The key schema: every key of a run under its prefix, and parsers that never raise."""

from __future__ import annotations

import pytest

from elastic_ft.keys import RdzvKey, RunKeys, count_suffix, parse_count, parse_rdzv_key, suffix


def test_every_run_key_lives_under_the_run_prefix() -> None:
    keys = RunKeys("/elastic_ft/", "job42")
    assert keys.root == "/elastic_ft/job42/"
    spelled = [
        keys.config,
        keys.closed,
        keys.alive("n"),
        keys.join(3, "n"),
        keys.result(3),
        keys.left(3, "n"),
        keys.rdzv_round(3),
        keys.round_data(3),
        keys.round_store(3),
        keys.escalation(3),
    ]
    assert all(key.startswith(keys.root) for key in spelled)
    assert keys.round_store(3).startswith(keys.round_data(3)) and keys.join(3, "n").startswith(keys.rdzv_round(3))


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("closed", RdzvKey("closed")),
        ("alive/n1", RdzvKey("alive", node="n1")),
        ("round/7/join/n1", RdzvKey("join", round=7, node="n1")),
        ("round/7/result", RdzvKey("result", round=7)),
        ("round/7/left/n1", RdzvKey("left", round=7, node="n1")),
    ],
)
def test_rendezvous_keys_parse_to_what_they_name(relative: str, expected: RdzvKey) -> None:
    assert parse_rdzv_key(relative) == expected
    keys = RunKeys("/p", "r")
    spelled = {
        "closed": lambda k: keys.closed,
        "alive": lambda k: keys.alive(k.node),
        "join": lambda k: keys.join(k.round, k.node),
        "result": lambda k: keys.result(k.round),
        "left": lambda k: keys.left(k.round, k.node),
    }[expected.kind](expected)
    assert spelled == keys.rdzv + relative  # the writer and the parser agree


@pytest.mark.parametrize(
    "relative",
    [
        "",
        "closed/extra",
        "alive/",
        "alive/a/b",
        "round/x/result",
        "round/-1/result",
        "round/1e400/result",
        "round/" + "9" * 40 + "/result",
        "round/７/result",  # a non-ASCII digit
        "round/1/join/",
        "round/1/join/a/b",
        "round/1/other",
        "round/1",
    ],
)
def test_malformed_rendezvous_keys_parse_to_none(relative: str) -> None:
    assert parse_rdzv_key(relative) is None


def test_suffix_parsers_are_total() -> None:
    assert suffix("/a/b/c", "/a/") == "b/c"
    assert suffix("/a/", "/a/") is None and suffix("/x/b", "/a/") is None
    assert count_suffix("/a/exits/12", "/a/exits/") == 12
    for bad in ("/a/exits/", "/a/exits/x", "/a/exits/1.5", "/a/exits/-3", "/b/exits/1"):
        assert count_suffix(bad, "/a/exits/") is None
    assert parse_count("0") == 0 and parse_count("") is None
