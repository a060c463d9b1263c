"""The package boundaries, checked on the source (``ast``, nothing is imported).

The rules, for every import statement anywhere in a module (function bodies and
``if TYPE_CHECKING:`` blocks included), relative imports resolved, and a name imported
from the top package (``from onceq import Admin``) resolved to the module it comes from:

* ``onceq.protocol`` (wire codec, codes, errors) imports from onceq only ``onceq.protocol``,
  and besides the standard library only ``msgpack``.
* ``onceq.log`` (record and index formats) imports from onceq only ``onceq.log``, and
  besides the standard library only ``msgpack`` and the record batches' compression codecs
  (``zstandard``, ``lz4``: optional, imported when a batch is compressed).
* ``onceq.storage`` imports from onceq only ``onceq.storage`` and ``onceq.log``: it raises
  errors of its own (``storage/errors.py``), which the broker maps to wire codes.
* ``onceq.broker`` never imports ``onceq.client``, ``onceq.idempotency``, ``onceq.spark``
  or ``onceq.cli``.
* ``onceq.client`` never imports ``onceq.storage``, ``onceq.broker``, ``onceq.idempotency``,
  ``onceq.spark`` or ``onceq.cli``: a client talks to the broker through the protocol only,
  and the layers built on it (idempotency, spark) plug in (``client/middleware.py``).
* ``onceq.idempotency`` (dedup records and stores, consumer middleware) imports the client
  side (``onceq.client``, ``onceq.protocol``, ``onceq.log``) and never ``onceq.storage``,
  ``onceq.broker``, ``onceq.spark`` or ``onceq.cli``.
* ``onceq.spark`` (the PySpark data source) is a client too: never ``onceq.storage``,
  ``onceq.broker`` or ``onceq.cli``.
* ``onceq.console`` (the web console) is a client too: never ``onceq.storage``,
  ``onceq.broker`` or ``onceq.cli``.
* ``onceq.cluster`` (the etcd coordination layer: its own client over etcd's JSON
  gateway, sessions, membership, election) imports from onceq only ``onceq.cluster`` and
  ``onceq.protocol``, and besides the standard library only ``msgpack``: the broker builds
  on it, never the other way round.
* ``onceq.rocketmq`` (the RocketMQ 5 gRPC endpoint, a front end of the broker) reaches the
  store through the broker's services only: it never imports ``onceq.storage``,
  ``onceq.client``, ``onceq.idempotency``, ``onceq.spark``, ``onceq.console`` or
  ``onceq.cli``; the broker never imports it (the command line hands it to the broker,
  ``Broker.front_ends``).
* Only ``onceq.rocketmq`` imports ``grpc`` and ``google`` (protobuf; the ``grpc`` extra).
* ``onceq.cli`` may import anything.
* Only ``onceq.spark`` imports ``pyspark``, ``pyarrow`` and ``numpy`` (the ``spark`` extra):
  every other module works without them.
* Only ``onceq.console`` imports ``starlette``, ``jinja2``, ``markupsafe``, ``uvicorn`` and
  ``multipart`` (the ``console`` extra).
* No import cycle runs through files of two different packages.

A violation fails with the file, the line and the import.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
STDLIB = frozenset(sys.stdlib_module_names)


@dataclass(frozen=True)
class Rule:
    package: str  # the rule applies to this package's modules
    allowed_onceq: frozenset[str] | None = None  # onceq subpackages it may import (None: any)
    forbidden_onceq: frozenset[str] = frozenset()
    allowed_third_party: frozenset[str] | None = None  # None: any
    forbidden_third_party: frozenset[str] = frozenset()
    exempt: frozenset[str] = frozenset()  # subpackages of ``package`` the rule skips
    owner: str = "onceq.spark"  # the package that alone imports ``forbidden_third_party``

    def applies_to(self, module: str) -> bool:
        if module != self.package and not module.startswith(self.package + "."):
            return False
        return not any(module == f"{self.package}.{e}"
                       or module.startswith(f"{self.package}.{e}.") for e in self.exempt)

    def why_not(self, target: str) -> str | None:
        """Why importing ``target`` (an absolute module name) breaks this rule, or None."""
        parts = target.split(".")
        if parts[0] == "onceq":
            sub = parts[1] if len(parts) > 1 else ""
            if sub in self.forbidden_onceq:
                return f"{self.package} must not import onceq.{sub}"
            if self.allowed_onceq is not None and sub not in self.allowed_onceq:
                allowed = ", ".join(f"onceq.{p}" for p in sorted(self.allowed_onceq))
                return f"{self.package} may import from onceq only {allowed}"
            return None
        if parts[0] in self.forbidden_third_party:
            return f"only {self.owner} may import {parts[0]}"
        if (self.allowed_third_party is not None and parts[0] not in STDLIB
                and parts[0] not in self.allowed_third_party):
            allowed = ", ".join(sorted(self.allowed_third_party)) or "nothing"
            return (f"{self.package} may import only the standard library and {allowed} "
                    "besides onceq")
        return None


SPARK_ONLY = frozenset({"pyspark", "pyarrow", "numpy"})
CONSOLE_ONLY = frozenset({"starlette", "jinja2", "markupsafe", "uvicorn", "multipart"})
GRPC_ONLY = frozenset({"grpc", "google"})

CLIENT_SIDE = frozenset({"storage", "broker", "cli"})

RULES = [
    Rule("onceq.protocol", allowed_onceq=frozenset({"protocol"}),
         allowed_third_party=frozenset({"msgpack"})),
    Rule("onceq.log", allowed_onceq=frozenset({"log"}),
         allowed_third_party=frozenset({"msgpack", "zstandard", "lz4"})),
    Rule("onceq.storage", allowed_onceq=frozenset({"storage", "log"})),
    Rule("onceq.broker", forbidden_onceq=frozenset({"client", "idempotency", "spark", "cli",
                                                     "rocketmq"})),
    Rule("onceq.client", forbidden_onceq=CLIENT_SIDE | {"idempotency", "spark"}),
    Rule("onceq.idempotency", forbidden_onceq=CLIENT_SIDE | {"spark"}),
    Rule("onceq.spark", forbidden_onceq=CLIENT_SIDE),
    Rule("onceq.console", forbidden_onceq=CLIENT_SIDE),
    Rule("onceq.cluster", allowed_onceq=frozenset({"cluster", "protocol"}),
         allowed_third_party=frozenset({"msgpack"})),
    Rule("onceq", forbidden_third_party=SPARK_ONLY, exempt=frozenset({"spark"})),
    Rule("onceq", forbidden_third_party=CONSOLE_ONLY, exempt=frozenset({"console"}),
         owner="onceq.console"),
    Rule("onceq.rocketmq", forbidden_onceq=frozenset(
        {"storage", "client", "idempotency", "spark", "console", "cli"})),
    Rule("onceq", forbidden_third_party=GRPC_ONLY, exempt=frozenset({"rocketmq"}),
         owner="onceq.rocketmq"),
]


def top_level_names(src: Path = SRC) -> dict[str, str]:
    """What ``from onceq import NAME`` takes, per name: the module it is defined in (the
    names imported when first used are named under ``TYPE_CHECKING``)."""
    out = {}
    for node in ast.walk(ast.parse((src / "onceq" / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = f"onceq.{node.module}"
    return out


TOP_LEVEL = top_level_names()


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool
                     ) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module name, names)`` of every import in ``source``.

    ``names`` are what ``from a import b, c`` takes (b and c may be submodules: a broken
    rule is also caught in ``from .. import storage``); empty for ``import a``.
    """
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                up = node.level - 1
                if up >= len(base_parts):
                    raise ValueError(f"{module}: relative import beyond the top package")
                base = ".".join(base_parts[:len(base_parts) - up])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.append((node.lineno, target,
                        [alias.name for alias in node.names if alias.name != "*"]))
    return out


def violations(path: Path, source: str, module: str, rules: list[Rule] = RULES
               ) -> list[str]:
    found = []
    for rule in rules:
        if not rule.applies_to(module):
            continue
        for line, target, names in imported_modules(source, module,
                                                    path.name == "__init__.py"):
            # the module itself, or else each imported name as a possible submodule (a
            # name from the top package: the module it comes from)
            subs = [TOP_LEVEL.get(n, f"onceq.{n}") if target == "onceq" else f"{target}.{n}"
                    for n in names]
            for candidate in ([] if target == "onceq" and names else [target]) + subs:
                why = rule.why_not(candidate)
                if why is not None:
                    found.append(f"{path}:{line}: imports {candidate} ({why})")
                    if candidate == target:
                        break
    return sorted(set(found))


def modules_of(package: str) -> list[Path]:
    root = SRC.joinpath(*package.split("."))
    return sorted(root.rglob("*.py"))


@pytest.mark.parametrize("rule", RULES, ids=[r.package for r in RULES])
def test_package_respects_its_import_boundary(rule):
    files = modules_of(rule.package)
    assert len(files) >= 2, f"no modules found for {rule.package} under {SRC}"
    found = []
    for path in files:
        found += violations(path.relative_to(SRC.parent), path.read_text(), module_name(path))
    assert not found, "import boundary broken:\n" + "\n".join(found)


# ------------------------------------------------------------ the checker itself can fail
def _check(module: str, source: str, is_package: bool = False) -> list[str]:
    parts = module.split(".")
    path = (Path("src", *parts, "__init__.py") if is_package
            else Path("src", *parts[:-1], parts[-1] + ".py"))
    return violations(path, source, module)


def test_client_importing_storage_or_broker_is_reported_with_file_and_import():
    src = ("from ..protocol.codes import RequestCode\n"
           "from ..storage.store import MessageStore\n"
           "def f():\n"
           "    import onceq.broker.broker\n"
           "    from .. import cli\n")
    found = _check("onceq.client.push", src)
    assert found == [
        "src/onceq/client/push.py:2: imports onceq.storage.store "
        "(onceq.client must not import onceq.storage)",
        "src/onceq/client/push.py:4: imports onceq.broker.broker "
        "(onceq.client must not import onceq.broker)",
        "src/onceq/client/push.py:5: imports onceq.cli "
        "(onceq.client must not import onceq.cli)",
    ]


def test_protocol_and_log_reaching_out_are_reported():
    assert _check("onceq.protocol.frame", "from ..log.record import MessageExt\n") == [
        "src/onceq/protocol/frame.py:1: imports onceq.log.record "
        "(onceq.protocol may import from onceq only onceq.protocol)"]
    assert _check("onceq.protocol.frame", "import zstandard\n") == [
        "src/onceq/protocol/frame.py:1: imports zstandard (onceq.protocol may import only the "
        "standard library and msgpack besides onceq)"]
    assert _check("onceq.log.record", "from ..client.message import Message\n") == [
        "src/onceq/log/record.py:1: imports onceq.client.message "
        "(onceq.log may import from onceq only onceq.log)"]
    assert _check("onceq.log", "from .. import _aio\n", is_package=True) == [
        "src/onceq/log/__init__.py:1: imports onceq._aio (onceq.log may import from onceq "
        "only onceq.log)"]
    assert _check("onceq.storage.put", "from ..protocol.errors import OnceqError\n") == [
        "src/onceq/storage/put.py:1: imports onceq.protocol.errors "
        "(onceq.storage may import from onceq only onceq.log, onceq.storage)"]


def test_a_name_from_the_top_package_is_checked_where_it_comes_from():
    assert TOP_LEVEL["Broker"] == "onceq.broker.broker"
    assert _check("onceq.client.pull", "from onceq import Broker, PullStatus\n") == [
        "src/onceq/client/pull.py:1: imports onceq.broker.broker "
        "(onceq.client must not import onceq.broker)"]
    assert _check("onceq.client.push", "from ..idempotency import option\n") == [
        "src/onceq/client/push.py:1: imports onceq.idempotency "
        "(onceq.client must not import onceq.idempotency)"]


def test_idempotency_reaching_into_the_broker_side_is_reported():
    assert _check("onceq.idempotency.wrap", "from ..storage.dedup import DedupWindow\n"
                  "from ..client.push import ConsumeStatus\n") == [
        "src/onceq/idempotency/wrap.py:1: imports onceq.storage.dedup "
        "(onceq.idempotency must not import onceq.storage)"]


def test_pyspark_outside_the_spark_package_is_reported():
    assert _check("onceq.client.pull", "import pyarrow as pa\n"
                  "from pyspark.sql.datasource import DataSource\n") == [
        "src/onceq/client/pull.py:1: imports pyarrow (only onceq.spark may import pyarrow)",
        "src/onceq/client/pull.py:2: imports pyspark.sql.datasource "
        "(only onceq.spark may import pyspark)"]
    assert _check("onceq.spark.reader", "import pyarrow as pa\n"
                  "from pyspark.sql.datasource import DataSource\n"
                  "from ..client.sync import SyncPullConsumer\n") == []
    assert _check("onceq.spark.reader", "from ..broker.broker import Broker\n") == [
        "src/onceq/spark/reader.py:1: imports onceq.broker.broker "
        "(onceq.spark must not import onceq.broker)"]


def test_the_console_reaching_into_the_broker_or_web_libraries_elsewhere_are_reported():
    assert _check("onceq.console.groups", "from ..broker.groups import Members\n"
                  "from ..client.admin import Admin\nfrom starlette.routing import Route\n"
                  "from ..cli.common import fail\n") == [
        "src/onceq/console/groups.py:1: imports onceq.broker.groups "
        "(onceq.console must not import onceq.broker)",
        "src/onceq/console/groups.py:4: imports onceq.cli.common "
        "(onceq.console must not import onceq.cli)"]
    assert _check("onceq.client.admin", "import jinja2\n") == [
        "src/onceq/client/admin.py:1: imports jinja2 (only onceq.console may import jinja2)"]
    assert _check("onceq.console.app", "import pyspark\n") == [
        "src/onceq/console/app.py:1: imports pyspark (only onceq.spark may import pyspark)"]


def test_the_cluster_layer_reaching_into_the_broker_or_other_libraries_is_reported():
    assert _check("onceq.cluster._election", "from ..broker.broker import Broker\n"
                  "import aiohttp\nfrom ..protocol.errors import ErrorCode\n"
                  "import msgpack\nfrom ._etcd import EtcdClient\n") == [
        "src/onceq/cluster/_election.py:1: imports onceq.broker.broker (onceq.cluster may "
        "import from onceq only onceq.cluster, onceq.protocol)",
        "src/onceq/cluster/_election.py:2: imports aiohttp (onceq.cluster may import only "
        "the standard library and msgpack besides onceq)"]


def test_allowed_imports_pass():
    assert _check("onceq.log.segment", "import struct\n"
                  "from .record import MessageExt\nimport msgpack\n") == []
    assert _check("onceq.client.push", "from .._aio import wait_event\n"
                  "from ..log.record import MessageExt\nimport asyncio\n") == []
    assert _check("onceq.broker.broker", "from ..storage.store import MessageStore\n") == []


# ------------------------------------------------------------ no cycles across packages
def import_graph(src: Path = SRC) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Module -> the onceq modules it imports (a name that is a submodule counts as it),
    and module -> its package (``onceq`` for the top package's own files)."""
    files = {module_name(p, src): p for p in (src / "onceq").rglob("*.py")}
    packages = {}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        rel = path.relative_to(src / "onceq").parts
        packages[module] = rel[0] if len(rel) > 1 else "onceq"
        edges = set()
        for _line, target, names in imported_modules(path.read_text(), module,
                                                     path.name == "__init__.py"):
            if not target.startswith("onceq"):
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in files]
            edges.update(subs or ([target] if target in files else []))
        edges.discard(module)
        graph[module] = edges
    return graph, packages


def cross_package_cycles(graph: dict[str, set[str]], packages: dict[str, str]
                         ) -> list[list[str]]:
    """The strongly connected components (Tarjan) whose files belong to two or more
    packages, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len({packages[m] for m in comp}) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_runs_through_two_packages():
    graph, packages = import_graph()
    assert len(graph) > 50 and graph["onceq.client.push"]
    assert cross_package_cycles(graph, packages) == []


def test_a_planted_cycle_across_packages_is_caught(tmp_path):
    pkg = tmp_path / "onceq"
    for rel, body in {"__init__.py": "", "client/__init__.py": "",
                      "client/push.py": "from ..idempotency import option\n",
                      "client/consume.py": "",
                      "idempotency/__init__.py": "",
                      "idempotency/option.py": "from ..client.push import X\n"
                                               "from ..client import consume\n",
                      "storage/__init__.py": "",
                      "storage/a.py": "from . import b\n",
                      "storage/b.py": "from . import a\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(body)
    graph, packages = import_graph(tmp_path)
    assert graph["onceq.idempotency.option"] == {"onceq.client.push", "onceq.client.consume"}
    assert packages["onceq.client"] == "client" and packages["onceq"] == "onceq"
    # the cycle inside storage is its own business; the one across packages is not
    assert cross_package_cycles(graph, packages) == [["onceq.client.push",
                                                      "onceq.idempotency.option"]]
