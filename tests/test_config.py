"""Configuration in one place: every KVFLOW_* environment variable the
library reads goes through kvflow.config, which lists them all, and
docs/config.md documents each one."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import kvflow
from kvflow import config
from _batches import bounded

PKG = pathlib.Path(kvflow.__file__).parent
DOCS = PKG.parent / "docs" / "config.md"


def test_no_environment_read_outside_config():
    """No module but kvflow/config.py reads os.environ or os.getenv for a
    KVFLOW_* name, and the C sources getenv() none."""
    bad = []
    for path in PKG.rglob("*.py"):
        if path.name == "config.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                line = path.read_text().splitlines()[node.lineno - 1]
                if "KVFLOW_" in line:
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno}: {line.strip()}")
    for path in [*PKG.rglob("*.pyx"), *PKG.rglob("*.pxi"), *(PKG / "_native").glob("*.[ch]")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(getenv|environ)\W.*KVFLOW_", line):
                bad.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert not bad, "environment read outside kvflow.config:\n" + "\n".join(bad)


def test_every_variable_read_is_listed():
    read = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id.startswith("env_") and node.args and isinstance(node.args[0], ast.Constant):
                read.add(node.args[0].value)
    assert read, "the walk found no env_*() call"
    assert read <= set(config.VARIABLES), f"read but not listed: {sorted(read - set(config.VARIABLES))}"


def test_docs_list_every_variable():
    text = DOCS.read_text()
    missing = [name for name in config.VARIABLES if f"`{name}`" not in text]
    assert not missing, f"docs/config.md does not document {missing}"


def test_a_malformed_variable_names_itself(monkeypatch):
    monkeypatch.setenv("KVFLOW_KEEPALIVE", "soon")
    with pytest.raises(kvflow.InvalidArgumentError, match="KVFLOW_KEEPALIVE"):
        kvflow.Engine()
    monkeypatch.setenv("KVFLOW_KEEPALIVE", "")          # empty: unset
    assert kvflow.Engine().keepalive == 5.0


async def test_secret_from_the_environment(monkeypatch):
    """Engine(secret=None) takes KVFLOW_SECRET: two such engines
    authenticate each other; an engine given another secret is refused."""
    monkeypatch.setenv("KVFLOW_SECRET", "from-the-environment")
    async with kvflow.Engine(protocols=("tcp",)) as a, kvflow.Engine(protocols=("tcp",)) as b, \
            kvflow.Engine(protocols=("tcp",), secret="another") as c:
        peer = await bounded(a.connect(b.address))
        assert peer.alive
        with pytest.raises(kvflow.AuthenticationError):
            await bounded(c.connect(b.address))
