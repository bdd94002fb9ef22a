"""One vLLM engine's NixlConnector, worker side, driven as vLLM's model runner drives it.

Run with the vLLM venv's python, kvflow's NIXL stand-in first on PYTHONPATH
(tests/_vllm.py's child_env), by tests/test_vllm_connector.py:

    python tests/_vllm_worker.py '{"role": "kv_producer"|"kv_consumer", "mode": "pull"|"push",
                                   "model": DIR, "engine_id": ID, "num_blocks": N,
                                   "block_size": B, "seed": S}'

What a vLLM engine does around its connector, and nothing instead of it:
- a VllmConfig for the tiny local model (tests/_vllm_model.py) with
  ``kv_connector = NixlConnector`` (pull, vLLM's NixlPullConnector) or
  ``NixlPushConnector`` (push), ``kv_buffer_device = cpu``, and the KV cache
  layout the connector asks for (``get_required_kvcache_layout``);
- vLLM's distributed state for one rank (gloo), as a CPU worker sets it up;
- the KV cache config vLLM's engine core computes (``get_kv_cache_configs``
  from the model's per-layer FullAttentionSpec) and the tensors the model
  runner allocates from it (``allocate_kv_cache``), filled with seeded bytes;
- the worker-role connector: ``register_kv_caches``, then its handshake
  payload handed to a scheduler-role connector of the same engine, which
  serves it on the side channel (``set_xfer_handshake_metadata_pp_aware``,
  as EngineCore does), the peer's worker fetching it there and adding the
  agent (``_nixl_handshake`` -> kvflow's ``add_remote_agent``);
- per step, ``bind_connector_metadata`` with the NixlConnectorMetadata the
  scheduler side builds for a request (fields filled as NixlBaseConnectorScheduler
  and NixlPushConnectorScheduler fill them), ``start_load_kv``,
  ``get_finished``, ``clear_connector_metadata``, until the request is done.

Protocol: JSON lines. The child prints ``@@KVF@@{"ready": ...}`` once set up
(engine id, side-channel port, the KV storage's size and each layer's offset,
block stride and block length within it); then reads one op per line and
answers ``@@KVF@@{"id": ..., "result": ...}`` or ``{"id": ..., "error": ...}``:
- ``dump {path}``: writes the whole KV storage (every layer, every block) to path;
- ``prefill {req}`` (producer): the engine step that computes the request's KV;
- ``send {req, blocks}`` (producer): the request finished with its KV in ``blocks``;
  steps until the connector reports it finished sending (in this or an earlier step);
- ``recv {req, blocks, remote}`` (consumer): the request is to receive its KV into
  ``blocks`` from the producer ``remote`` (engine id, host, port, request id and,
  pull, its blocks); steps until the connector reports it finished receiving;
- ``stats``: the connector's transfer stats; ``exit``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

MARK = "@@KVF@@"
STEP_S = 0.005
OP_TIMEOUT_S = float(os.environ.get("KVFLOW_VLLM_OP_TIMEOUT", "120"))


def say(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch

    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig, set_current_vllm_config)
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (NixlConnectorMetadata, NixlPullConnector,
                                                                   NixlPushConnector)
    from vllm.utils.network_utils import get_open_port
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    role, mode = cfg["role"], cfg["mode"]
    connector_cls = NixlPullConnector if mode == "pull" else NixlPushConnector
    block_size, num_blocks = cfg["block_size"], cfg["num_blocks"]

    model_config = ModelConfig(model=cfg["model"], dtype="float32", max_model_len=512, seed=0)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512,
                                         is_encoder_decoder=False),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector=connector_cls.__name__, kv_role=role,
                                            kv_buffer_device="cpu", engine_id=cfg["engine_id"]),
    )
    layout = connector_cls.get_required_kvcache_layout(vllm_config)
    if layout is not None:
        vllm_config.cache_config.kv_cache_layout = layout

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)

        hf = model_config.hf_text_config
        head_size = hf.hidden_size // hf.num_attention_heads
        spec = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                    block_size=block_size, num_kv_heads=hf.num_key_value_heads, head_size=head_size,
                    dtype=torch.float32)
                for i in range(hf.num_hidden_layers)}
        page = next(iter(spec.values())).page_size_bytes
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        kv_cache_config = get_kv_cache_configs(vllm_config, [spec], [page * num_blocks * len(spec)])[0]
        assert kv_cache_config.num_blocks == num_blocks, kv_cache_config

        worker = connector_cls(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                                      vllm_config.cache_config.get_resolved_kv_cache_layout())
        storage = next(iter(kv_caches.values())).untyped_storage()
        base = storage.data_ptr()
        raw = torch.frombuffer(memoryview((ctypes_buf := _as_ctypes(base, storage.nbytes()))), dtype=torch.uint8)
        gen = torch.Generator().manual_seed(cfg["seed"])
        raw.copy_(torch.randint(0, 256, (storage.nbytes(),), dtype=torch.uint8, generator=gen))
        layers = {}
        for name, t in kv_caches.items():
            assert t.untyped_storage().data_ptr() == base, name
            layers[name] = {"offset": t.data_ptr() - base, "block_stride": t.stride(0) * t.element_size(),
                            "block_len": t[0].numel() * t.element_size(), "num_blocks": t.shape[0],
                            "shape": list(t.shape), "stride": list(t.stride())}
        worker.register_kv_caches(kv_caches)
        sched = connector_cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        sched.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})

        side_host = sched.connector_scheduler.side_channel_host
        side_port = sched.connector_scheduler.side_channel_port
        say({"ready": {"engine_id": cfg["engine_id"], "side_host": side_host, "side_port": side_port,
                       "storage_bytes": storage.nbytes(), "layers": layers, "layout": layout,
                       "nixl": sys.modules["nixl._api"].__file__}})

        # What get_finished reported, over all steps: the engine reports a request once,
        # in whichever step its transfer completed (the consumer may finish reading
        # before the producer's worker saw the request's lease, as in vLLM).
        finished: tuple[set, set] = (set(), set())

        def step(meta) -> None:
            """One engine step of the connector's worker side, as the model runner runs it."""
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()
            sending, recving = worker.get_finished(set())
            worker.clear_connector_metadata()
            finished[0].update(sending or ())
            finished[1].update(recving or ())

        def until(req: str, which: int, first) -> dict:
            deadline = time.monotonic() + OP_TIMEOUT_S
            meta = first
            steps = 0
            while True:
                step(meta)
                done = finished[which]
                steps += 1
                errors = worker.get_block_ids_with_load_errors()
                if errors:
                    raise RuntimeError(f"blocks with load errors: {sorted(errors)}")
                if req in done:
                    done.discard(req)
                    return {"steps": steps}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{req} not finished after {OP_TIMEOUT_S} s ({steps} steps)")
                meta = NixlConnectorMetadata()
                time.sleep(STEP_S)

        lease_s = 60.0
        for line in sys.stdin:
            msg = json.loads(line)
            op, args, mid = msg["op"], msg.get("args", {}), msg.get("id")
            try:
                if op == "dump":
                    with open(args["path"], "wb") as f:
                        f.write(bytes(memoryview(ctypes_buf)))
                    res = {"bytes": storage.nbytes()}
                elif op == "prefill":
                    # The step that computes the request's KV: it is in the batch
                    # (update_state_after_alloc). Only then does the consumer hear of it.
                    m = NixlConnectorMetadata()
                    m.reqs_in_batch = {args["req"]}
                    step(m)
                    res = {}
                elif op == "send":
                    req, blocks = args["req"], [list(args["blocks"])]
                    # The next step: request_finished held its blocks for the consumer
                    # under a lease (and, push, handed them to the writer).
                    m = NixlConnectorMetadata()
                    m.reqs_to_send = {req: time.perf_counter() + lease_s}
                    m.scheduler_clock = time.perf_counter()
                    if mode == "push":
                        m.push_finished_blocks = {req: blocks}
                    res = until(req, 0, m)
                elif op == "recv":
                    req, blocks, remote = args["req"], [list(args["blocks"])], args["remote"]
                    m = NixlConnectorMetadata()
                    params = {"do_remote_prefill": True, "do_remote_decode": False,
                              "remote_engine_id": remote["engine_id"], "remote_request_id": remote["req"],
                              "remote_host": remote["host"], "remote_port": remote["port"], "tp_size": 1,
                              "remote_block_ids": [list(remote["blocks"])] if mode == "pull" else ()}
                    m.add_new_req_to_recv(req, blocks, params, awaiting_kvs=True)
                    if mode == "push":
                        m.push_registrations = {req: {
                            "request_id": req, "decode_engine_id": cfg["engine_id"],
                            "decode_host": side_host, "decode_port": side_port, "decode_tp_size": 1,
                            "local_block_ids": blocks, "remote_engine_id": remote["engine_id"],
                            "remote_host": remote["host"], "remote_port": remote["port"],
                            "remote_tp_size": 1, "remote_pp_size": 1}}
                    res = until(req, 1, m)
                elif op == "stats":
                    s = worker.get_kv_connector_stats()
                    res = s.data if s is not None else {}
                elif op == "exit":
                    say({"id": mid, "result": {}})
                    break
                else:
                    raise ValueError(f"unknown op {op}")
                say({"id": mid, "result": res})
            except Exception as e:  # the test reports it
                say({"id": mid, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        worker.shutdown()
        sched.shutdown()


def _as_ctypes(addr: int, n: int):
    import ctypes

    return (ctypes.c_uint8 * n).from_address(addr)


if __name__ == "__main__":
    main()
