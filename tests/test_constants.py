"""Constants shared by C and Python are defined once, in the C headers, and
Python takes them from kvflow._core. These tests read the headers
themselves (a small parser, independent of the Cython declarations) and
fail if any Python name disagrees: a constant copied by hand and then
changed on one side only is caught here."""
from __future__ import annotations

import ast
import pathlib
import re

import kvflow
from kvflow import _core
from kvflow.control import wire
from kvflow.memory import LOCAL_WRITE, Access
from kvflow.schedule import rails
import kvflow.status as status

ROOT = pathlib.Path(kvflow.__file__).parent
NATIVE = ROOT / "_native"


def header_constants(*names: str) -> dict[str, int]:
    """Every `KVF_X = value` enum member and `#define KVF_X value` of the
    headers, evaluated (values are integer expressions: 0x.., <<, ull)."""
    out: dict[str, int] = {}
    for name in names:
        text = re.sub(r"/\*.*?\*/", "", (NATIVE / name).read_text(), flags=re.S)
        for m in re.finditer(r"#define[ \t]+(KVF_\w+)[ \t]+([^\n]+)", text):
            out[m.group(1)] = _value(m.group(2))
        for body in re.findall(r"enum\s*\{([^}]*)\}", text):
            for m in re.finditer(r"(KVF_\w+)\s*=\s*([^,]+)", body):
                out[m.group(1)] = _value(m.group(2))
    return out


def _value(expr: str) -> int:
    expr = re.sub(r"(?<=[0-9a-fA-F])(ull|ul|u|ll)\b", "", expr.strip(), flags=re.I)
    return int(eval(compile(ast.parse(expr, mode="eval"), "<header>", "eval"), {"__builtins__": {}}))


C = header_constants("kvf.h", "wire.h")


def test_header_parser_reads_the_headers():
    # a parser that silently found nothing would pass everything below
    assert C["KVF_ECLOSED"] == 9 and C["KVF_MAGIC"] == 0x464B and C["KVF_MAX_PAYLOAD"] == 64 << 20


def test_status_codes():
    for name, value in _core.STATUS.items():
        assert C[f"KVF_{name}"] == value, name
        assert getattr(status, name) == value, name
    native = {k[4:] for k, v in C.items() if re.fullmatch(r"KVF_(OK|E[A-Z]+)", k)}
    assert native == set(_core.STATUS), "a status code of kvf.h is not exposed to Python"
    for name, value in _core.STATUS_BITS.items():
        assert C[f"KVF_STATUS_{name}"] == value, name


def test_status_bits_decode_an_rdma_error():
    # device 2 (index 1), IBV_WC_REM_ACCESS_ERR (10), KVF_EREMOTE
    code = C["KVF_EREMOTE"] | (10 << C["KVF_STATUS_WC_SHIFT"]) | (2 << C["KVF_STATUS_DEV_SHIFT"])
    e = status.status_error(code, peer="p", index=3, op=_core.OP_WRITE, devices=["rxe0", "rxe1"])
    assert isinstance(e, kvflow.RemoteAccessError) and "rxe1" in str(e) and "REM_ACCESS_ERR" in str(e)


def test_ops_and_access_bits():
    assert (_core.OP_WRITE, _core.OP_READ) == (C["KVF_OP_WRITE"], C["KVF_OP_READ"])
    assert int(Access.READ) == C["KVF_ACCESS_READ"] and int(Access.WRITE) == C["KVF_ACCESS_WRITE"]
    assert LOCAL_WRITE == C["KVF_ACCESS_LOCAL_WRITE"]
    assert _core.MAX_DEVS == C["KVF_MAX_DEVS"]


def test_wire_header_and_hello():
    for name, value in _core.WIRE.items():
        if name != "HEADER_SIZE":
            assert C[f"KVF_{name}" if name != "VERSION" else "KVF_WIRE_VERSION"] == value, name
    assert wire.DATA_HEADER.size == _core.WIRE["HEADER_SIZE"] == 32
    # the Python header layout follows kvf_hdr's fields, in order
    text = (NATIVE / "wire.h").read_text()
    fields = re.search(r"typedef struct \{(.*?)\} kvf_hdr;", text, re.S).group(1)
    types = re.findall(r"(uint\d+)_t\s+\w+;", fields)
    assert "".join({"uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q"}[t] for t in types) == \
        wire.DATA_HEADER.format.lstrip("<")
    assert wire.DATA_MAGIC == C["KVF_MAGIC"] and wire.DATA_WIRE_VERSION == C["KVF_WIRE_VERSION"]
    assert (wire.DATA_HELLO, wire.DATA_HELLO_ACK) == (C["KVF_F_HELLO"], C["KVF_F_HELLO_ACK"])
    assert (wire.DATA_ROLE_DATA, wire.DATA_ROLE_ACK) == (C["KVF_ROLE_DATA"], C["KVF_ROLE_ACK"])
    assert (rails.EPOCH_SHIFT, rails.EPOCH_MAX) == (C["KVF_CONN_EPOCH_SHIFT"], C["KVF_CONN_EPOCH_MAX"])
    assert C["KVF_CONN_INDEX_MASK"] == (1 << C["KVF_CONN_EPOCH_SHIFT"]) - 1


def test_no_python_copy_of_a_status_table():
    """The old hand copy (`OK, EINVAL, ... = range(10)`) or any literal
    status assignment must not come back anywhere in the package."""
    names = "|".join(n for n in _core.STATUS if n != "OK")   # OK: also Mooncake's own code (compat)
    pattern = re.compile(rf"^\s*(?:{names})\s*(?:,\s*(?:{names})\s*)*=\s*(?:range\(|\d)", re.M)
    for path in ROOT.rglob("*.py"):
        assert not pattern.search(path.read_text()), f"{path}: status codes copied by hand"
