"""Configuration parsing and bad input: clear errors before any etcd traffic."""

from __future__ import annotations

import typing

import pytest
from pydantic import BeforeValidator
from pydantic.fields import FieldInfo
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ft.job_config import JobConfigError, ObservabilitySection, RendezvousSection, parse_job_config
from elastic_ft.rendezvous.config import (
    CONF_KEYS,
    EtcdftSettings,
    RendezvousConf,
    RendezvousConfigError,
    make_settings,
    settings_from_parameters,
)
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler


def settings(**overrides: object) -> EtcdftSettings:
    values = {"run_id": "job", "endpoint": "127.0.0.1:2379", "min_nodes": 1, "max_nodes": 2, **overrides}
    return make_settings(**values)  # type: ignore[arg-type]


def test_defaults_are_documented_and_applied() -> None:
    s = settings()
    assert s.join_timeout == CONF_KEYS["join_timeout"][0] == 600
    assert s.last_call_timeout == CONF_KEYS["last_call_timeout"][0]
    assert s.lease_ttl == CONF_KEYS["lease_ttl"][0]
    assert s.run_prefix == "/elastic_ft/job/"
    assert (s.spare_nodes, s.capacity) == (0, 2)
    assert settings(spare_nodes="2").capacity == 4  # --rdzv-conf gives text
    assert all(description for _, description in CONF_KEYS.values())


def test_torchrun_timeout_key_and_precedence() -> None:
    assert settings(timeout="900").join_timeout == 900
    # torchrun always passes timeout; an explicit join_timeout wins.
    assert settings(timeout="900", join_timeout="30").join_timeout == 30


def test_from_torchrun_parameters() -> None:
    params = RendezvousParameters(
        "etcdft",
        "h1:2379,h2:2379",
        "job42",
        2,
        4,
        local_addr="10.1.1.1",
        timeout="900",
        last_call_timeout="5",
        lease_ttl="5",
    )
    s = settings_from_parameters(params)
    assert (s.min_nodes, s.max_nodes, s.last_call_timeout, s.lease_ttl, s.local_addr) == (2, 4, 5, 5, "10.1.1.1")
    assert [e.host for e in s.endpoints] == ["h1", "h2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"bogus_key": "1"}, "unknown etcdft rdzv conf key.*'bogus_key'"),
        ({"last_call_timeout": "soon"}, "last_call_timeout='soon' is not a number"),
        ({"join_timeout": "-5"}, "join_timeout='-5' is out of range"),
        ({"join_timeout": "0"}, "join_timeout='0' is out of range"),
        ({"timeout": "nan"}, "timeout='nan' is not finite"),
        ({"lease_ttl": "1.5"}, "lease_ttl='1.5' is not whole"),
        ({"lease_ttl": "0"}, "lease_ttl='0' is out of range"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes=3 exceeds max_nodes=2"),
        ({"min_nodes": 0}, "min_nodes=0 is invalid"),
        ({"run_id": ""}, "rdzv id '' is invalid"),
        ({"run_id": "a/b"}, "rdzv id 'a/b' is invalid"),
        ({"etcd_prefix": "relative"}, "etcd_prefix='relative' is invalid"),
        ({"endpoint": "a:b"}, "port 'b'"),
        ({"cacert": "/ca.pem"}, "no endpoint uses https"),
        # Values that would pass a looser check, then crash later (some after writing to etcd).
        ({"store_timeout": 1e300}, "store_timeout=1e[+]?300 is out of range; expected .* <= 2592000"),
        ({"lease_ttl": 1e300}, "lease_ttl=1e[+]?300 is out of range"),
        ({"request_timeout": 1e12}, "request_timeout=1000000000000.0 is out of range"),
        ({"join_timeout": 10**400}, "join_timeout=1000.* is out of range"),
        ({"min_nodes": 10**21, "max_nodes": 10**21}, "min_nodes=1000000000000000000000 is invalid"),
        ({"max_nodes": 100_001}, "max_nodes=100001 is invalid; expected an integer from 1 to 100000"),
        ({"run_id": "job\n"}, "rdzv id 'job.n' is invalid"),
        ({"run_id": "j" * 129}, "rdzv id 'jjj.* is invalid; expected 1 to 128"),
        ({"run_id": "rdzv"}, "rdzv id 'rdzv' is invalid.*none of"),
        ({"etcd_prefix": "/elastic_ft/other-run/round/0/store"}, "etcd_prefix=.* is invalid"),
        ({"etcd_prefix": "/a b"}, "etcd_prefix='/a b' is invalid"),
        ({"endpoint": "etcd host:2379"}, "'etcd host:2379'.* is malformed"),
        ({"endpoint": "https://localhost:2379", "cacert": "/no/such/ca.pem"}, "cacert file '/no/such/ca.pem' cannot"),
        ({"endpoint": "https://localhost:2379", "cert": __file__}, "cert and key go together"),
        ({"spare_nodes": "-1"}, "spare_nodes='-1' is invalid; expected a whole number of nodes from 0 to 99998"),
        ({"spare_nodes": "one"}, "spare_nodes='one' is invalid"),
        ({"spare_nodes": True}, "spare_nodes=True is invalid"),
        ({"spare_nodes": 99_999}, "spare_nodes=99999 is invalid.*at most 100000"),
        ({"events_kept": "0"}, "events_kept='0' is invalid; expected an integer from 1 to 100000"),
        ({"events_kept": "many"}, "events_kept='many' is invalid"),
        ({"events_kept": 100_001}, "events_kept=100001 is invalid"),
    ],
)
def test_bad_settings(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=message):
        settings(**overrides)


def test_bad_input_fails_before_contacting_etcd() -> None:
    """An unknown key must fail at once, even with an endpoint nobody listens on."""
    params = RendezvousParameters("etcdft", "192.0.2.1:1", "job", 1, 1, typo_key="1")
    with pytest.raises(RendezvousConfigError, match="typo_key"):
        EtcdftRendezvousHandler.from_parameters(params)


def test_keys_of_torchs_other_backends_are_translated_or_ignored_with_one_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: object
) -> None:
    # What torchrun passes for a --rdzv-conf written for c10d or etcd-v2.
    params = RendezvousParameters(
        backend="etcdft",
        endpoint="127.0.0.1:2379",
        run_id="job",
        min_nodes=1,
        max_nodes=2,
        timeout=900,
        read_timeout="60",
        heartbeat_timeout="2.5",
        close_timeout="10",
        keep_alive_interval="5",
        keep_alive_max_attempt="3",
        is_host="true",
    )
    with caplog.at_level("WARNING", logger="elastic_ft.rendezvous.config"):
        s = settings_from_parameters(params)
        settings_from_parameters(params)
    assert (s.join_timeout, s.request_timeout, s.lease_ttl) == (900, 60, 3)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "ignores rdzv conf key(s) close_timeout, is_host, keep_alive_interval, keep_alive_max_attempt" in warnings[0]
    # etcdft's own key wins over the torch key standing for it.
    assert settings(read_timeout="60", request_timeout="2").request_timeout == 2
    assert settings(heartbeat_timeout="30", lease_ttl="4").lease_ttl == 4
    # etcd-v2's protocol=https makes endpoints without a scheme secure.
    assert [e.secure for e in settings(endpoint="a:1,http://b:2", protocol="https").endpoints] == [True, False]
    assert not any(e.secure for e in settings(protocol="HTTP").endpoints)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"protocol": "ftp"}, "rdzv conf protocol='ftp' is invalid; expected http or https"),
        ({"heartbeat_timeout": "-1"}, "rdzv conf heartbeat_timeout='-1'"),
        ({"read_timeout": "soon"}, "rdzv conf read_timeout='soon'"),
    ],
)
def test_bad_torch_keys_get_clear_errors(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=message):
        settings(**overrides)


def test_every_problem_is_named_at_once_not_the_first_only() -> None:
    # A launch line with three mistakes costs one try, not three.
    with pytest.raises(RendezvousConfigError) as raised:
        settings(run_id="round", lease_ttl="2.5", events_kept="0", protocol="ftp", bogus="1")
    message = str(raised.value)
    assert message.startswith("5 rendezvous settings are invalid: (1) "), message
    for part in (
        "protocol='ftp'",
        "unknown etcdft rdzv conf key(s) 'bogus'",
        "rdzv id 'round'",
        "lease_ttl='2.5' is not whole",
        "events_kept='0'",
    ):
        assert part in message, (part, message)
    # Dependent checks are not piled on a value already reported: a bad max_nodes is one problem.
    with pytest.raises(RendezvousConfigError) as raised:
        settings(min_nodes=2, max_nodes="many", spare_nodes="1")
    assert str(raised.value) == "max_nodes='many' is invalid; expected an integer from 1 to 100000"


def _checks(annotation: object) -> set[object]:
    """The functions of the BeforeValidators anywhere in a field's annotation."""
    found: set[object] = set()
    for part in typing.get_args(annotation):
        items = part.metadata if isinstance(part, FieldInfo) else [part]
        found |= {item.func for item in items if isinstance(item, BeforeValidator)}
        if not isinstance(part, (FieldInfo, BeforeValidator)):
            found |= _checks(part)
    return found


def test_the_job_config_and_rdzv_conf_check_each_value_with_one_model() -> None:
    for name in ("join_timeout", "last_call_timeout", "lease_ttl"):
        ours, theirs = RendezvousSection.model_fields[name], RendezvousConf.model_fields[name]
        assert ours.description == theirs.description
        assert _checks(ours.annotation) == _checks(theirs.rebuild_annotation()) != set()  # one type, one check
    assert ObservabilitySection().events_kept == RendezvousConf().events_kept == settings().events_kept
    # One check and one expectation, each config in its own voice.
    expected = r"expected whole seconds \(etcd leases\)"
    with pytest.raises(RendezvousConfigError, match=rf"^rdzv conf lease_ttl='2.5' is not whole; {expected}$"):
        settings(lease_ttl="2.5")
    with pytest.raises(JobConfigError, match=rf"rendezvous.lease_ttl=2.5 is invalid; {expected}$"):
        parse_job_config({"rendezvous": {"lease_ttl": 2.5}})
    # --rdzv-conf gives text; in YAML, quoted text is a mistake.
    assert settings(lease_ttl="4", events_kept=" 12 ").lease_ttl == 4
    with pytest.raises(JobConfigError, match="rendezvous.lease_ttl='4' is invalid; expected a number of seconds"):
        parse_job_config({"rendezvous": {"lease_ttl": "4"}})
    with pytest.raises(JobConfigError, match="observability.events_kept='12' is invalid; expected an integer"):
        parse_job_config({"observability": {"events_kept": "12"}})
