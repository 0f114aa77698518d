"""Run torch's own ``StoreTestBase`` (``test/distributed/test_store.py``) against ``EtcdStore`` on a real etcd.

torch's test files are not in its wheel, so this takes the file from a
PyTorch checkout: ``python scripts/torch_store_tests.py PATH/test_store.py``.
Only the ``StoreTestBase`` class is taken from it (with the module's own
imports), so the rest of that file (RPC, CUDA, TCPStore-only tests) need
not import here. Each of its tests runs on a fresh ``EtcdStore`` under its
own prefix, directly and through a ``PrefixStore`` as torch's agent uses it.
Needs ``expecttest`` (torch's test utilities import it).

Not run by CI (it needs PyTorch's repository); ``tests/etcd/test_store.py``
holds the same contract as our own tests.
"""

from __future__ import annotations

import argparse
import ast
import sys
import unittest
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.runtime.reaper import ensure_reaper


def store_test_base(path: Path) -> type:
    """torch's ``StoreTestBase`` from ``path``, executed with the module's top-level imports only."""
    tree = ast.parse(path.read_text(), str(path))
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "StoreTestBase"]
    if not classes:
        raise SystemExit(f"{path}: no class StoreTestBase (expected torch's test/distributed/test_store.py)")
    namespace: dict[str, Any] = {"__name__": "torch_test_store"}
    for node in imports:
        try:
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)  # noqa: S102 - torch's own test code
        except ImportError as error:  # an RPC or CUDA helper this runner does not use
            print(f"skipped an import of {path.name}: {error}", file=sys.stderr)
    exec(compile(ast.Module(classes, []), str(path), "exec"), namespace)  # noqa: S102
    return namespace["StoreTestBase"]


def test_cases(base: type, server: EtcdServer) -> list[type]:
    clients: list[EtcdClient] = []
    # A PrefixStore over a Python store (any, torch's own test stores too) calls into it only while Python
    # holds it: pybind drops the overrides with the last Python reference. torch's agent holds its store.
    stores: list[EtcdStore] = []

    def etcd_store() -> EtcdStore:
        client = EtcdClient(server.endpoints)
        clients.append(client)
        store = EtcdStore(
            client, f"/elastic_ft/torch-tests-{uuid.uuid4().hex[:8]}/round/0/store/", timedelta(seconds=300)
        )
        stores.append(store)
        return store

    class EtcdStoreTest(unittest.TestCase, base):  # type: ignore[misc, valid-type]
        def _create_store(self) -> dist.Store:
            return etcd_store()

    class PrefixEtcdStoreTest(unittest.TestCase, base):  # type: ignore[misc, valid-type]
        def _create_store(self) -> dist.Store:
            return dist.PrefixStore("test_prefix", etcd_store())

    EtcdStoreTest.clients = clients  # closed by main()
    return [EtcdStoreTest, PrefixEtcdStoreTest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_store", type=Path, help="torch's test/distributed/test_store.py")
    args = parser.parse_args()
    base = store_test_base(args.test_store)
    ensure_reaper()  # the etcd goes with this script, even if it is killed
    with EtcdServer() as server:
        cases = test_cases(base, server)
        suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(case) for case in cases)
        result = unittest.TextTestRunner(verbosity=2).run(suite)
        for client in cases[0].clients:
            client.close()
    print(
        f"\n{result.testsRun - len(result.failures) - len(result.errors) - len(result.skipped)} passed, "
        f"{len(result.failures) + len(result.errors)} failed, {len(result.skipped)} skipped "
        f"of {result.testsRun}"
    )
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
