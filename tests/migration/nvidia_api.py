"""The public API of ``nvidia_resiliency_ext.inprocess`` 0.4.1, as data: what ``docs/migration.md`` must cover.

``python -m tests.migration.nvidia_api`` (with NVIDIA's package installed)
prints the snapshot kept beside this file; ``test_migration.py`` checks the
migration table against the snapshot, and the snapshot against the
installed package when there is one.

Public: the package's own exports, and the names defined in the modules the
package exports or its API reference documents (not starting with ``_``);
a class brings its constructor's parameters and the public members defined
on it. The package's other modules are internal: one entry each.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pathlib
import pkgutil
import sys
from typing import Any

PACKAGE = "nvidia_resiliency_ext.inprocess"
SNAPSHOT = pathlib.Path(__file__).with_name("nvidia_inprocess_0.4.1.json")
PUBLIC_MODULES = (
    "abort",
    "completion",
    "compose",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "rank_assignment",
    "rank_filter",
    "state",
    "store",
    "terminate",
    "wrap",
)


def _parameters(obj: Any) -> list[str]:
    function = obj.__init__ if inspect.isclass(obj) else obj
    if (
        inspect.isclass(obj)
        and "__init__" not in vars(obj)
        and not any(
            "__init__" in vars(base) for base in obj.__mro__[1:] if base.__module__.startswith("nvidia_resiliency_ext")
        )
    ):
        return []
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _describe(obj: Any) -> dict[str, Any]:
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        members = sorted(n for n in vars(obj) if not n.startswith("_"))
        return {"kind": "class", "parameters": _parameters(obj), "members": members}
    if callable(obj):
        return {"kind": "function", "parameters": _parameters(obj)}
    return {"kind": "value"}


def extract() -> dict[str, Any]:
    """The snapshot of the installed NVIDIA package."""
    package = importlib.import_module(PACKAGE)
    names: dict[str, dict[str, Any]] = {}
    for name in sorted(n for n in dir(package) if not n.startswith("_")):
        obj = getattr(package, name)
        if inspect.ismodule(obj) or getattr(obj, "__module__", "").startswith(PACKAGE):
            names[name] = _describe(obj)
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        names.setdefault(module_name, {"kind": "module"})
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if isinstance(obj, type(json)) or not (inspect.isclass(obj) or callable(obj)):
                continue
            names[f"{module_name}.{name}"] = _describe(obj)
    internal = sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in PUBLIC_MODULES and m.name not in names
    )
    version = importlib.import_module("importlib.metadata").version("nvidia-resiliency-ext")
    return {"package": PACKAGE, "version": version, "names": names, "internal_modules": internal}


def load() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


if __name__ == "__main__":
    json.dump(extract(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
