"""The docs that code can keep true: the API reference is current, every error a user can meet is explained,
the quickstart's script is the one that is tested."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import elastic_ft

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_api_reference_is_generated_from_the_current_code() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def _error_classes() -> dict[str, type[BaseException]]:
    """Every exception class elastic-ft defines outside its test helpers, by name."""
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(elastic_ft.__path__, "elastic_ft."):
        if module_info.name.startswith("elastic_ft.testing"):
            continue
        module = importlib.import_module(module_info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[name] = obj
    return found


def test_troubleshooting_explains_every_error_a_user_can_meet() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = sorted(name for name in _error_classes() if not re.search(rf"`{name}`", text))
    assert not missing, f"docs/troubleshooting.md does not mention {missing}"


def test_quickstart_shows_the_script_the_tests_run() -> None:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    script = (ROOT / "examples" / "quickstart.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert script in blocks, "docs/quickstart.md must show examples/quickstart.py as it is"
