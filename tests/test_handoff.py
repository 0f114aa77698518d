"""The node -> worker hand-off: what the agent encodes, the Wrapper decodes, and bad values rejected."""

from __future__ import annotations

import json

import pytest

from elastic_ft.etcd.endpoints import TlsFiles, parse_endpoints
from elastic_ft.handoff import STORE_ENV, StoreHandoff, job_config_from_env, job_config_to_env
from elastic_ft.job_config import load_job_config

HANDOFF = StoreHandoff(
    endpoints=parse_endpoints("10.0.0.1:2379,https://[::1]:2380"),
    prefix="/elastic_ft/job/round/3/store/",
    tls=TlsFiles(cacert=__file__),  # any readable file: the hand-off checks that it can be read
    connect_timeout=10.0,
    request_timeout=5.0,
    timeout=300.0,
)


def test_store_handoff_round_trips_through_the_environment() -> None:
    assert StoreHandoff.from_env(HANDOFF.to_env()) == HANDOFF
    assert StoreHandoff.from_env({}) is None


def test_job_config_round_trips_through_the_environment() -> None:
    config = load_job_config("nodes: {min: 2, max: 4}\nwrapper: {soft_timeout: 7}\n")
    assert job_config_from_env(job_config_to_env(config)) == config
    assert job_config_from_env({}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"endpoints": "127.0.0.1:2379"}, "expected a non-empty list of strings"),
        ({"endpoints": []}, "expected a non-empty list of strings"),
        ({"endpoints": ["a:notaport"]}, "port 'notaport'"),
        ({"prefix": "relative/"}, "expected an absolute key prefix"),
        ({"request_timeout": -1}, "request_timeout=-1 is out of range"),
        ({"timeout": "soon"}, "timeout='soon' is not a number"),
        ({"cert": 5}, "cert=5: expected a file path"),
        ({"cacert": "/no/such/ca.pem"}, "TLS cacert file '/no/such/ca.pem' cannot be read"),
        ({"timeout": 1e300}, "timeout=1e[+]?300 is out of range"),
        ({"endpoints": ["etcd host:2379"]}, "is malformed"),
    ],
)
def test_bad_store_handoff_names_the_variable_and_the_field(change: dict[str, object], message: str) -> None:
    document = {**json.loads(HANDOFF.to_env()[STORE_ENV]), **change}
    with pytest.raises(ValueError, match=f"{STORE_ENV}=.*is not a valid etcd store description: .*{message}"):
        StoreHandoff.from_env({STORE_ENV: json.dumps(document)})


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"prefix": "/p/"}'])
def test_unparseable_store_handoff_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match=f"{STORE_ENV}=.*is not a valid etcd store description"):
        StoreHandoff.from_env({STORE_ENV: text})


def test_worker_handoff_round_trips_and_rejects_malformed_values() -> None:
    from elastic_ft.handoff import WORKER_ENV, WorkerHandoff

    for handoff in (WorkerHandoff(), WorkerHandoff(4), WorkerHandoff(4, joining=True)):
        assert WorkerHandoff.from_env(handoff.to_env()) == handoff
    assert WorkerHandoff.from_env({}) is None
    for text in (
        '{"active_world_size": 0, "joining": false}',
        '{"active_world_size": 4}',
        "[4]",
        "nope",
        '{"active_world_size": true, "joining": false}',
        '{"active_world_size": 4, "joining": "yes"}',
    ):
        with pytest.raises(ValueError, match=f"{WORKER_ENV}=.* is not a valid worker hand-off"):
            WorkerHandoff.from_env({WORKER_ENV: text})
