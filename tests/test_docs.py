"""The docs that code can keep true: the API reference is current, every error a user can meet is explained,
the quickstart's script is the one that is tested."""

from __future__ import annotations

import importlib
import inspect
import json
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


def test_the_readme_shows_the_minimal_example_as_it_is() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert (ROOT / "examples" / "minimal.py").read_text() in blocks, "README.md must show examples/minimal.py as it is"


#: Every document a user reads.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Where a document names a module of its own: ``python -m elastic_ft...``.
MODULE_RUN = re.compile(r"python3? -m (elastic_ft(?:\.\w+)+)")
#: A dotted name in backticks: a module, or an attribute of one.
DOTTED_NAME = re.compile(r"`(elastic_ft(?:\.\w+)+)`")
#: An import line anywhere in a document, in a Python block, a diff or the prose.
IMPORT_LINE = re.compile(
    r"^[+ ]?(from elastic_ft(?:\.\w+)* import [\w, ]+|import elastic_ft(?:\.\w+)*)\s*$", re.MULTILINE
)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def _block_imports(block: str) -> list[str]:
    """The import statements of a Python block (compiling it: a block that is not Python fails here)."""
    import ast

    imports = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
    return imports


@pytest.mark.integration
def test_every_import_and_module_the_docs_show_exists() -> None:
    """Every Python block of the README and ``docs/`` compiles and its imports import, every ``from elastic_ft``
    line imports, every ``python -m elastic_ft...`` names a module, and every backticked ``elastic_ft.`` name is a
    module or an attribute of one, all in a fresh interpreter."""
    imports: dict[str, str] = {}
    modules: dict[str, str] = {}
    names: dict[str, str] = {}
    broken = []
    for path in DOCUMENTS:
        text, where = path.read_text(), path.relative_to(ROOT).as_posix()
        for number, block in enumerate(_python_blocks(text)):
            try:
                imports.update({line: where for line in _block_imports(block)})
            except SyntaxError as error:
                broken.append(f"{where}: Python block {number} does not compile: {error}")
        imports.update({line.strip(): where for line in IMPORT_LINE.findall(text)})
        modules.update({name: where for name in MODULE_RUN.findall(text)})
        names.update({name: where for name in DOTTED_NAME.findall(text)})
    checker = f"""
import importlib, importlib.util, json, sys
failed = []
for line, where in {sorted(imports.items())!r}:
    try:
        exec(line, {{}})
    except Exception as error:
        failed.append(f"{{where}}: {{line}}: {{error!r}}")
for name, where in {sorted(modules.items())!r}:
    if importlib.util.find_spec(name) is None:
        failed.append(f"{{where}}: python -m {{name}}: no such module")
for name, where in {sorted(names.items())!r}:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                value = getattr(value, part)
        except AttributeError:
            failed.append(f"{{where}}: `{{name}}`: neither a module nor an attribute of one")
        break
print(json.dumps(failed))
"""
    done = subprocess.run([sys.executable, "-c", checker], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = broken + json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
    assert len(imports) > 10 and len(names) > 50, (len(imports), len(names))  # the scan found what it checks
