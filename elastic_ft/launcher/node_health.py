"""Node health checks before each rendezvous join: a node that fails them does not join, and says why.

``ftrun``'s agent runs :class:`NodeHealthChecks` before every join (the
first, and each after a fault). While any check fails, the node stays out
of the rendezvous: the job goes on without it (or with a spare), the
problems are logged when they change, written to the run's
``health/<node>`` key for ``elastic-ft status``, and the checks run again
every ``period`` seconds. Once they pass, the key says so and the node
joins.

Checks (``ftrun --node-health-check SPEC``, repeatable):

* ``exec:COMMAND``: a shell command; exit status 0 is healthy, otherwise
  its output's last line is the reason;
* ``python:MODULE:FUNCTION``: a callable taking no argument; it returns
  None (or an empty list) when healthy, a string or a list of strings
  naming the problems otherwise; raising is a problem too;
* ``http://...``, ``https://...``: a node health service; a 2xx answer
  within the timeout is healthy (ft_launcher's
  ``--ft-node-health-check-endpoint``).

Built in: NIC links (on by default, ``--no-nic-health-check``; a link up
when ``ftrun`` started that is down or flapped since fails),
``--storage-health-check PATH`` (a writable directory, answered within the
timeout), and the GPUs when ``torch.cuda`` is available.
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_ft.runtime import node_checks
from elastic_ft.runtime.waits import pause
from elastic_ft.untrusted import MalformedRecord, json_object

log = logging.getLogger(__name__)

#: Seconds a check may take before it counts as failed.
DEFAULT_CHECK_TIMEOUT = 30.0
#: Seconds between two rounds of checks while the node is unhealthy.
DEFAULT_PERIOD = 10.0


class NodeHealthSpecError(ValueError):
    """A ``--node-health-check`` value that names no check ftrun can run."""


@dataclass(frozen=True)
class HealthSpec:
    """One user check, parsed from its ``--node-health-check`` text (no I/O until it runs)."""

    text: str
    kind: str  #: ``exec``, ``python`` or ``http``
    target: str

    @classmethod
    def parse(cls, text: str) -> HealthSpec:
        if text.startswith("exec:") and text[5:].strip():
            return cls(text, "exec", text[5:].strip())
        if text.startswith("python:"):
            target = text[len("python:") :]
            module, _, function = target.rpartition(":")
            if module and function.isidentifier():
                return cls(text, "python", target)
        if text.startswith(("http://", "https://")):
            return cls(text, "http", text)
        raise NodeHealthSpecError(
            f"--node-health-check {text!r}: expected exec:COMMAND, python:MODULE:FUNCTION or an http(s):// URL"
        )

    def run(self, timeout: float) -> list[str]:
        """The problems this check finds now; empty when healthy."""
        if self.kind == "exec":
            return _run_command(self.target, timeout)
        if self.kind == "python":
            return _run_callable(self.target)
        return _ask_endpoint(self.target, timeout)


def _run_command(command: str, timeout: float) -> list[str]:
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return [f"exec:{command}: no answer within {timeout:g} s"]
    if done.returncode == 0:
        return []
    said = (done.stdout + done.stderr).strip().splitlines()
    return [f"exec:{command}: exit status {done.returncode}" + (f": {said[-1]}" if said else "")]


def _run_callable(target: str) -> list[str]:
    module_name, _, name = target.rpartition(":")
    try:
        check = getattr(importlib.import_module(module_name), name)
        found = check()
    except Exception as error:  # noqa: BLE001 - a check that raises found a problem
        return [f"python:{target}: {type(error).__name__}: {error}"]
    if not found:
        return []
    if isinstance(found, str):
        return [f"python:{target}: {found}"]
    return [f"python:{target}: {problem}" for problem in found]


def _ask_endpoint(url: str, timeout: float) -> list[str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            status = answer.status
            body = answer.read(4096).decode(errors="replace").strip()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read(4096).decode(errors="replace").strip()
    except (urllib.error.URLError, OSError) as error:
        return [f"{url}: unreachable: {getattr(error, 'reason', error)}"]
    if 200 <= status < 300:
        return []
    return [f"{url}: HTTP {status}" + (f": {body.splitlines()[0][:200]}" if body else "")]


@dataclass
class NodeHealthChecks:
    """Every check of this node, built in and the user's; :meth:`problems` runs them all."""

    specs: list[HealthSpec] = field(default_factory=list)
    nic: bool = True
    storage_paths: list[str] = field(default_factory=list)
    timeout: float = DEFAULT_CHECK_TIMEOUT
    period: float = DEFAULT_PERIOD
    #: NIC links when the checks were set up (``ftrun`` start): a link down since is this node's fault.
    nic_baseline: dict[str, node_checks.NicLink] | None = None

    def __post_init__(self) -> None:
        for name, value in (("timeout", self.timeout), ("period", self.period)):
            if not value > 0:
                raise ValueError(f"node health check {name} must be > 0 seconds, got {value!r}")

    def start(self) -> NodeHealthChecks:
        """Take the NIC baseline (reads sysfs); returns self."""
        if self.nic and self.nic_baseline is None:
            self.nic_baseline = node_checks.nic_links()
        return self

    def problems(self) -> list[str]:
        found: list[str] = []
        if self.nic and self.nic_baseline is not None:
            found += [
                f"NIC {problem}" for problem in node_checks.lost_links(self.nic_baseline, node_checks.nic_links())
            ]
        found += node_checks.storage_problems(self.storage_paths, self.timeout)
        found += node_checks.gpu_problems(None, self.timeout)
        for spec in self.specs:
            found += spec.run(self.timeout)
        return found


@dataclass(frozen=True)
class HealthRecord:
    """What ``health/<node>`` holds: the node's last verdict, for ``elastic-ft status``."""

    healthy: bool
    problems: tuple[str, ...]
    checked_at: float

    def to_json(self) -> bytes:
        return json.dumps(
            {"healthy": self.healthy, "problems": list(self.problems), "checked_at": self.checked_at}
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> HealthRecord:
        """Raises MalformedRecord on anything but a record this module wrote (etcd's content is untrusted)."""
        data = json_object(raw)
        if data is None:
            raise MalformedRecord("not a JSON object")
        healthy, problems, checked_at = data.get("healthy"), data.get("problems"), data.get("checked_at")
        if not isinstance(healthy, bool):
            raise MalformedRecord(f"healthy must be true or false, got {healthy!r}")
        if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
            raise MalformedRecord(f"problems must be a list of strings, got {problems!r}")
        if isinstance(checked_at, bool) or not isinstance(checked_at, int | float):
            raise MalformedRecord(f"checked_at must be a number, got {checked_at!r}")
        return cls(healthy, tuple(problems), float(checked_at))


def wait_until_healthy(
    checks: NodeHealthChecks,
    publish: Callable[[HealthRecord], Any],
    *,
    sleep: Callable[[float], Any] = pause,
    node: str = "",
) -> HealthRecord:
    """Run the checks until they pass, publishing each verdict; logs the problems when they change.

    ``publish`` failing (etcd away) is logged and does not stop the checks:
    the verdict matters to this node's join, the record only to ``status``.
    """
    said: tuple[str, ...] | None = None
    while True:
        problems = tuple(checks.problems())
        record = HealthRecord(not problems, problems, time.time())
        try:
            publish(record)
        except Exception as error:  # noqa: BLE001 - the record is informational
            log.warning("node %s: could not publish its health record: %s", node, error)
        if not problems:
            if said:
                log.warning("node %s is healthy again: joining the rendezvous", node)
            return record
        if problems != said:
            log.error(
                "node %s failed its health checks, so it does not join the rendezvous (again in %g s): %s",
                node,
                checks.period,
                "; ".join(problems),
            )
            said = problems
        sleep(checks.period)
