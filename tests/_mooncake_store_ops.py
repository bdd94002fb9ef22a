"""One sequence of Mooncake Store calls, run on whatever `mooncake.store`
is importable (kvflow's through the shim, or the real wheel) against the
master at argv[1]; prints {call: result} as one JSON line. The same
sequence on both gives the same results (tests/test_compat_mooncake_store.py);
the calls where kvflow answers otherwise on purpose are in `divergent`
(docs/store.md lists them)."""
from __future__ import annotations

import ctypes
import json
import sys
import time

from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

LEASE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5


def run(master: str) -> dict:
    out: dict = {}
    s = MooncakeDistributedStore()

    def op(name: str, fn) -> None:
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - recorded
            r = f"raised {type(e).__name__}"
        if isinstance(r, (bytes, bytearray)):
            r = "bytes:" + bytes(r).decode("latin-1")
        elif isinstance(r, list):
            r = [("bytes:" + bytes(x).decode("latin-1")) if isinstance(x, (bytes, bytearray)) else x for x in r]
        out[name] = r

    op("setup", lambda: s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master))
    op("put", lambda: s.put("k1", b"hello"))
    op("put_same_key_again", lambda: s.put("k1", b"hello"))
    op("put_same_key_other_size", lambda: s.put("k1", b"hello world"))
    op("get", lambda: s.get("k1"))
    op("get_missing", lambda: s.get("nope"))
    op("get_size", lambda: s.get_size("k1"))
    op("get_size_missing", lambda: s.get_size("nope"))
    op("is_exist", lambda: s.is_exist("k1"))
    op("is_exist_missing", lambda: s.is_exist("nope"))
    op("batch_is_exist", lambda: s.batch_is_exist(["k1", "nope", ""]))
    op("batch_is_exist_empty", lambda: s.batch_is_exist([]))
    op("put_empty_key", lambda: s.put("", b"x"))
    op("put_empty_value", lambda: s.put("k_empty", b""))
    op("get_empty_key", lambda: s.get(""))
    op("put_non_str_key", lambda: s.put(5, b"x"))
    op("put_str_value", lambda: s.put("ks", "text"))
    op("put_parts", lambda: s.put_parts("kp", b"ab", b"cd", memoryview(b"ef")))
    op("get_put_parts", lambda: s.get("kp"))
    op("put_batch", lambda: s.put_batch(["b1", "b2"], [b"one", b"two"]))
    op("put_batch_length_mismatch", lambda: s.put_batch(["b3", "b4"], [b"one"]))
    op("put_batch_one_exists", lambda: s.put_batch(["b1", "b5"], [b"one", b"five"]))
    op("get_batch", lambda: s.get_batch(["b1", "nope", "b2", "b5"]))
    buf = (ctypes.c_ubyte * 8192)()
    ptr = ctypes.addressof(buf)
    ctypes.memmove(ptr, bytes(range(256)) * 8, 2048)
    op("register_buffer", lambda: s.register_buffer(ptr, 8192))
    op("register_buffer_again", lambda: s.register_buffer(ptr, 8192))
    op("register_buffer_overlapping", lambda: s.register_buffer(ptr + 100, 100))
    op("register_buffer_negative", lambda: s.register_buffer(-1, 100))
    op("put_from", lambda: s.put_from("pf", ptr, 1000))
    op("get_put_from", lambda: s.get("pf"))
    op("get_into", lambda: s.get_into("pf", ptr + 4096, 2048))
    op("get_into_bytes", lambda: bytes(buf[4096:5096]) == bytes(buf[0:1000]))
    op("get_into_small_buffer", lambda: s.get_into("pf", ptr + 4096, 10))
    op("get_into_missing", lambda: s.get_into("nope", ptr + 4096, 2048))
    op("batch_put_from", lambda: s.batch_put_from(["bp1", "bp2"], [ptr, ptr + 100], [100, 200]))
    op("batch_put_from_length_mismatch", lambda: s.batch_put_from(["bp3", "bp4"], [ptr], [100, 100]))
    op("batch_put_from_one_exists", lambda: s.batch_put_from(["bp1", "bp5"], [ptr, ptr + 100], [100, 100]))
    op("batch_put_from_empty", lambda: s.batch_put_from([], [], []))
    op("batch_get_into", lambda: s.batch_get_into(["bp1", "nope", "bp2"], [ptr + 5000, ptr + 5200, ptr + 5400],
                                                   [100, 100, 150]))
    op("batch_get_into_length_mismatch", lambda: s.batch_get_into(["bp1", "bp2"], [ptr], [100]))
    op("batch_get_into_empty", lambda: s.batch_get_into([], [], []))
    op("multi_put", lambda: s.batch_put_from_multi_buffers(["m1", "m2"], [[ptr, ptr + 10], [ptr + 20]],
                                                           [[10, 10], [5]]))
    op("multi_get_plain", lambda: s.get("m1"))
    op("multi_get", lambda: s.batch_get_into_multi_buffers(["m1", "m2", "nope"],
                                                           [[ptr + 6000, ptr + 6010], [ptr + 6020], [ptr + 6030]],
                                                           [[10, 10], [5], [5]]))
    op("multi_get_bytes", lambda: bytes(buf[6000:6025]) == bytes(buf[0:20]) + bytes(buf[20:25]))
    op("multi_get_too_small", lambda: s.batch_get_into_multi_buffers(["m1"], [[ptr + 6000, ptr + 6010]], [[10, 5]]))
    op("multi_put_length_mismatch", lambda: s.batch_put_from_multi_buffers(["m3", "m4"], [[ptr]], [[10]]))
    op("get_buffer", lambda: (lambda h: [h.size(), bytes(h).decode()])(s.get_buffer("k1")))
    op("get_buffer_missing", lambda: s.get_buffer("nope"))
    op("batch_get_buffer", lambda: [None if b is None else bytes(b).decode() for b in s.batch_get_buffer(["k1", "x"])])
    op("get_into_ranges", lambda: s.get_into_ranges([ptr + 7000], [["pf", "nope"]], [[[0, 8], [16]]],
                                                    [[[1, 30], [0]]], [[[4, 3], [4]]]))
    rc = ReplicateConfig()
    op("replicate_config_str", lambda: str(rc))
    rc0 = ReplicateConfig()
    rc0.replica_num = 0
    op("put_replica_num_0", lambda: s.put("r0", b"rr", rc0))
    rc2 = ReplicateConfig()
    rc2.replica_num = 2
    op("put_replica_num_2_one_segment", lambda: s.put("r2", b"rr", rc2))
    rcp = ReplicateConfig()
    rcp.preferred_segment = "nosuch:1234"
    op("put_unknown_preferred_segment", lambda: s.put("rp", b"rr", rcp))
    ttl = ReplicateConfig()
    ttl.soft_pin_ttl_ms = 1000
    op("upsert_ttl_without_enable", lambda: s.upsert("u1", b"abc", ttl))
    pin = ReplicateConfig()
    pin.soft_pin_action = SoftPinAction.ENABLE
    pin.soft_pin_ttl_ms = 1000
    op("put_soft_pin", lambda: s.put("u1", b"abc", pin))
    op("upsert_replace", lambda: s.upsert("u1", b"abcdef"))
    op("get_upserted", lambda: s.get("u1"))
    op("put_larger_than_local_buffer", lambda: s.put("big", b"x" * (17 << 20)))
    op("remove_missing", lambda: s.remove("nope"))
    op("batch_remove_force", lambda: s.batch_remove(["b1", "nope"], True))
    op("remove_by_regex_bad_pattern", lambda: s.remove_by_regex("([", True))
    op("unregister_buffer", lambda: s.unregister_buffer(ptr))
    op("unregister_buffer_again", lambda: s.unregister_buffer(ptr))
    op("health_check", lambda: s.health_check())
    time.sleep(LEASE_S + 0.3)             # past every get's lease
    op("remove", lambda: s.remove("k1"))
    op("remove_all", lambda: s.remove_all())
    op("is_exist_after_remove_all", lambda: s.is_exist("b2"))
    op("close", lambda: s.close())
    op("close_again", lambda: s.close())
    op("health_check_closed", lambda: s.health_check())
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])), flush=True)
