"""One PD role of SGLang's disaggregation, run by tests/test_sglang_backend.py
in its own process (SGLang's runtime context is per process):

    python tests/_sglang_pd.py prefill|decode BACKEND BOOTSTRAP_PORT ROOMS OUT.json [mha|mla]

ROOMS: comma-separated bootstrap rooms; a room written "7x" is one whose
decode side gives page indices past the end of its pool (bad input: the
transfer must fail on both sides, write nothing, and the rooms after it
must still succeed).

Everything on the SGLang side is SGLang's own code, as its schedulers run it
(sglang/srt/disaggregation/prefill.py and decode.py): the server arguments
published as the process's runtime context, get_kv_class for the backend,
KVArgs filled from SGLang's real MHATokenToKVPool (or MLATokenToKVPool: one
latent buffer per layer, SGLang's MLA path) and MetadataBuffers (on the
CPU), the bootstrap server, the manager, one sender or receiver per request
with the schedulers' call order. What stands in for the scheduler is only the
loop that polls them. BACKEND "kvflow" is registered by the PYTHONPATH shim
(python -m kvflow.compat.sglang.shim), as a user would run SGLang: nothing
here calls kvflow; "mooncake" is SGLang's Mooncake backend on real Mooncake.

The prefill fills every page it sends with a pattern of (room, page, layer)
and the decode checks every byte of its destination pages and aux records;
OUT.json gets what each side saw.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")       # loopback only
os.environ.setdefault("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "60")
os.environ.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "60")

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, POOL_PAGES = 4, 2, 64, 16, 256
DTYPE = torch.bfloat16
TIMEOUT = 90.0


def pattern(room: int, page: int, layer: int, kind: int, nbytes: int) -> np.ndarray:
    seed = (room * 1_000_003 + page * 131 + layer * 7 + kind) & 0xFFFFFFFF
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> int:
    role, backend, port, rooms_arg, out = sys.argv[1:6]
    mla = sys.argv[6:7] == ["mla"]
    rooms = [int(r.rstrip("x")) for r in rooms_arg.split(",")]
    bad_rooms = {int(r[:-1]) for r in rooms_arg.split(",") if r.endswith("x")}
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    sa = ServerArgs(model_path="dummy", device="cpu", host="127.0.0.1", disaggregation_mode=role,
                    disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=int(port),
                    page_size=PAGE)
    runtime_context.publish(sa, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
    # one rank, no torch.distributed: the pipeline group is never used at pp_size 1
    runtime_context.get_parallel().override_permanently(pp_group=None)

    from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers,
                                                 TransferBackend, get_kv_class, get_kv_transfer_buf_infos,
                                                 setup_state_kv_args)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    tb = TransferBackend(backend)
    mode = DisaggregationMode(role)
    if mla:
        pool = MLATokenToKVPool(POOL_PAGES * PAGE, PAGE, DTYPE, kv_lora_rank=128, qk_rope_head_dim=32,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
                                end_layer=LAYERS)
    else:
        pool = MHATokenToKVPool(POOL_PAGES * PAGE, PAGE, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                                start_layer=0, end_layer=LAYERS)
    meta = MetadataBuffers(len(rooms) + 2, hidden_size=64, hidden_states_dtype=DTYPE, max_sampling_mask_tokens=1)

    # prefill.py / decode.py _init_kv_manager, for a plain MHA pool at TP 1
    kv_args = get_kv_class(tb, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = 0
    kv_args.prefill_end_layer = LAYERS
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = []
    if not mla:                     # prefill.py sets the head counts for MHA pools only
        kv_args.kv_head_num = HEADS
        kv_args.total_kv_head_num = HEADS
    kv_args.page_size = PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = ""
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, LAYERS)

    bootstrap = None
    if mode is DisaggregationMode.PREFILL:
        bootstrap = get_kv_class(tb, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=int(port))
    if backend == "mooncake":
        # what the scheduler's startup does for this backend (maybe_init_shared_mooncake_transfer_engine)
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import \
            init_mooncake_transfer_engine
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    mgr = get_kv_class(tb, KVClassType.MANAGER)(kv_args, mode, sa, mla)
    bufs = [np.frombuffer((ctypes_buf(p, n)), dtype=np.uint8) for p, n in
            zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens)]
    aux = [np.frombuffer(ctypes_buf(p, n), dtype=np.uint8) for p, n in
           zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens)]
    addr = f"127.0.0.1:{port}"
    report: dict = {"role": role, "backend": backend, "manager": type(mgr).__name__, "buffers": len(bufs),
                    "engine": type(getattr(mgr, "engine", None)).__name__, "rooms": {}}
    # Requests of several sizes; page indices scattered over the pool, different on each side.
    sizes = {room: 1 + (room * 7) % 40 for room in rooms}
    rng = np.random.default_rng(0 if role == "prefill" else 1)
    free = rng.permutation(np.arange(1, POOL_PAGES)).astype(np.int32)
    pages, cursor = {}, 0
    for room in rooms:
        pages[room] = free[cursor:cursor + sizes[room]]
        cursor += sizes[room]
    deadline = time.monotonic() + TIMEOUT

    def item_range(buf_lens: list[int], b: int, index: int) -> slice:
        return slice(index * buf_lens[b], (index + 1) * buf_lens[b])

    if mode is DisaggregationMode.PREFILL:
        senders = {}
        for i, room in enumerate(rooms):
            for b, buf in enumerate(bufs):
                for k, p in enumerate(pages[room]):
                    buf[item_range(kv_args.kv_item_lens, b, p)] = pattern(room, k, b, 0, kv_args.kv_item_lens[b])
            for a, buf in enumerate(aux):
                buf[item_range(kv_args.aux_item_lens, a, i + 1)] = pattern(room, 0, a, 1, kv_args.aux_item_lens[a])
            senders[room] = get_kv_class(tb, KVClassType.SENDER)(
                mgr=mgr, bootstrap_addr=addr, bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)

        def start(room: int, s) -> None:
            # finalize_bootstrap, then send_kv_chunk in two chunks as chunked prefill does
            prefix = s.pop_decode_prefix_len()
            s.init(len(pages[room]), rooms.index(room) + 1)
            half = len(pages[room]) // 2
            chunks = [pages[room][:half], pages[room][half:]] if half else [pages[room]]
            for chunk in chunks:
                if s.should_send_kv_chunk(len(chunk), chunk is chunks[-1]):
                    s.send(chunk)
            report["rooms"][room] = {"decode_prefix_len": prefix}

        def landed(room: int, s) -> None:
            report["rooms"].setdefault(room, {}).update(state="Success",
                                                        bytes=s.get_transfer_metric().transfer_total_bytes)

        drive(senders, "prefill", start, landed, report, deadline)
        time.sleep(1.0)     # let the decode side read its status before the manager goes
    else:
        while not mgr.try_ensure_parallel_info(addr):
            assert time.monotonic() < deadline, "decode: no parallel info from the prefill bootstrap server"
            time.sleep(0.05)
        receivers = {}
        for room in rooms:
            r = get_kv_class(tb, KVClassType.RECEIVER)(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            r.init(0)
            receivers[room] = r

        def start(room: int, r) -> None:
            dst = pages[room] + POOL_PAGES if room in bad_rooms else pages[room]
            r.send_metadata(dst, rooms.index(room) + 1)

        def landed(room: int, r) -> None:
            bad = 0
            for b, buf in enumerate(bufs):
                for k, p in enumerate(pages[room]):
                    want = pattern(room, k, b, 0, kv_args.kv_item_lens[b])
                    bad += not np.array_equal(buf[item_range(kv_args.kv_item_lens, b, p)], want)
            i = rooms.index(room)
            for a, buf in enumerate(aux):
                want = pattern(room, 0, a, 1, kv_args.aux_item_lens[a])
                bad += not np.array_equal(buf[item_range(kv_args.aux_item_lens, a, i + 1)], want)
            nbytes = sum(kv_args.kv_item_lens) * len(pages[room]) + sum(kv_args.aux_item_lens)
            report["rooms"][room] = {"state": "Success", "bad_items": bad, "verified_bytes": nbytes}

        drive(receivers, "decode", start, landed, report, deadline)
    if mode is DisaggregationMode.DECODE:
        # nothing outside the requests' own pages was written (page 0 and the unused ones stay zero)
        used = np.zeros(POOL_PAGES, bool)
        for room in rooms:
            if room not in bad_rooms:
                used[pages[room]] = True
        stray = 0
        for b, buf in enumerate(bufs):
            item = kv_args.kv_item_lens[b]
            stray += int(np.count_nonzero(buf.reshape(-1, item)[:POOL_PAGES][~used].any(axis=1)))
        report["stray_pages"] = stray
    with open(out, "w") as f:
        json.dump(report, f)
    del bootstrap
    os._exit(0)     # SGLang's managers run non-daemon helpers; the test only needs the report


def drive(requests: dict, role: str, start, landed, report: dict, deadline: float) -> None:
    """The scheduler's part: polls every request until it is Success or
    Failed; start(room, obj) once it waits for input, landed(room, obj) on
    Success, then clear()."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    pending, started = dict(requests), set()
    while pending:
        assert time.monotonic() < deadline, f"{role}: rooms {sorted(pending)} did not finish"
        for room, obj in list(pending.items()):
            st = obj.poll()
            if st == KVPoll.Failed:
                try:
                    obj.failure_exception()
                except Exception as e:  # noqa: BLE001 - reported
                    report["rooms"][room] = {"state": "Failed", "error": str(e)}
                del pending[room]
            elif st == KVPoll.WaitingForInput and room not in started:
                started.add(room)
                start(room, obj)
            elif st == KVPoll.Success:
                landed(room, obj)
                obj.clear()
                del pending[room]
        time.sleep(0.002)


def ctypes_buf(ptr: int, n: int):
    import ctypes
    return (ctypes.c_uint8 * n).from_address(ptr)


if __name__ == "__main__":
    sys.exit(main())
