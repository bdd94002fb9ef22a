"""The store soak (tools/soak.py --mode store), shortened: about 25 s of
randomised puts, gets checked byte for byte, exists and removes on the
KVCache pool (a standalone master, three holder processes, a writer
process) while holders are SIGKILLed and SIGSTOPped, the writer is killed
mid-put and the small pool evicts; then the segment space must balance and
come back to zero. KVFLOW_STORE_SOAK_SECONDS sets the length."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from soaklib import store  # noqa: E402

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("KVFLOW_STORE_SOAK_SECONDS", "25"))
SEED = 5


async def test_store_soak_mixed_load_with_faults():
    res = await store.store_soak(SECONDS, SEED, log=print)
    print("\n" + store.table(res))
    t = res.tally

    # the invariants: no wrong byte, only typed errors, every loss explained,
    # no stopped holder's object dropped, nothing leaked, a clean master
    assert res.problems() == [], res.problems()
    assert t.wrong_bytes == 0 and not t.untyped and not t.unexplained and not t.hangs
    assert res.accounting["used"] == res.accounting["objects_bytes"]
    assert res.accounting["used_after_remove_all"] == 0 and res.accounting["objects_after_remove_all"] == 0

    # the load and the faults happened
    for op, _ in store.OPERATIONS:
        assert t.ops[op] > 0, (op, dict(t.ops))
    assert t.ops["writer put"] > 0
    assert t.objects_put > 100 and t.bytes_verified > 0
    assert t.faults["holder killed"] >= 1 and t.faults["holder stopped"] >= 1, dict(t.faults)
    assert t.faults["writer killed mid-put"] >= 1, dict(t.faults)
    assert t.stop_checked > 0 and not t.dropped_by_stop
    assert res.evictions > 0 and t.lost["evicted"] > 0       # the pool was full
    assert sum(t.uncertain.values()) > 0                      # a killed writer's keys were judged
