"""kvflow's CUDA module: built with nvcc, importable without a driver, and,
where a GPU is usable, GPU memory registered and moved over every host
provider (staged: kvflow.paths.staged). The GPU tests skip with the reason
where CUDA is not usable (these build machines have nvcc and no driver);
tools/gpu_check.sh runs them on a GPU machine."""
from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kvflow
import kvflow.cuda
from kvflow._cuda import FATBIN, built

from _batches import bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_kvflow_imports_nothing_of_cuda():
    code = ("import sys, kvflow, numpy as np\n"
            "e = kvflow.features\n"
            "from kvflow.memory import buffer_span\n"
            "buffer_span(np.zeros(10, np.uint8)); buffer_span((np.zeros(10, np.uint8).ctypes.data, 10))\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    if not os.path.exists("/dev/nvidiactl"):
        assert out.stdout.strip() == "[]"


def test_available_never_raises():
    ok = kvflow.cuda.available()
    assert isinstance(ok, bool)
    assert (kvflow.cuda.reason() is None) == ok
    assert kvflow.cuda.device_count() >= (1 if ok else 0)
    if not ok:
        assert isinstance(kvflow.cuda.reason(), str) and kvflow.cuda.reason()


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="no nvcc on this machine: the CUDA module is not built")
def test_cuda_module_built_with_nvcc():
    """With nvcc found at build time (KVFLOW_CUDA=auto), the fatbin holds the
    kernels for Ampere and Hopper and the features say it was built."""
    assert built() and kvflow.features["cuda"]
    image = open(FATBIN, "rb").read()
    assert image[:4] == bytes.fromhex("50ed55ba")          # a fatbin's magic
    for name in (b"kvf_flag_write", b"kvf_doorbells", b"kvf_layer_put"):
        assert name in image


def test_without_driver_cuda_calls_are_typed_errors():
    if kvflow.cuda.available():
        pytest.skip("CUDA is usable here")
    from kvflow._cuda import driver
    with pytest.raises(kvflow.ProviderUnavailableError, match="CUDA is not usable here"):
        driver.Stream(0)
    assert driver.pointer_location(0x7F0000000000) is None


# ---------------------------------------------------------------- on a GPU

def gpu(test):
    """A test that needs a usable CUDA device (marked cuda)."""
    return pytest.mark.cuda(pytest.mark.skipif(
        not kvflow.cuda.available(), reason=f"CUDA not usable here: {kvflow.cuda.reason()}")(test))


def _torch():
    return pytest.importorskip("torch")


def _sha_tensor(t) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


@gpu
async def test_register_kinds_on_gpu(make_engine):
    torch = _torch()
    eng = await make_engine(protocols=["tcp"])
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    r = eng.register(t, name="kv")
    assert (r.kind, r.device, r.addr, r.length) == ("cuda", 0, t.data_ptr(), t.numel())
    eng.deregister(r)
    raw = eng.register((t.data_ptr() + 4096, 8192))               # a raw device pointer, as SGLang passes
    assert raw.kind == "cuda"
    eng.deregister(raw)
    with pytest.raises(kvflow.InvalidArgumentError, match="allocation"):
        eng.register((t.data_ptr(), t.numel() + (64 << 20)))     # runs past the allocation
    cupy = pytest.importorskip("cupy")
    c = cupy.zeros(1 << 16, dtype=cupy.uint8)
    rc = eng.register(c)
    assert rc.kind == "cuda" and rc.addr == c.data.ptr
    from cuda.bindings import driver as cu
    err, dptr = cu.cuMemAlloc(1 << 16)
    assert err == cu.CUresult.CUDA_SUCCESS
    try:
        rd = eng.register((dptr, 1 << 16))                      # cuda-python's CUdeviceptr
        assert rd.kind == "cuda"
        eng.deregister(rd)
    finally:
        cu.cuMemFree(dptr)


@gpu
@pytest.mark.parametrize("protocol", ["tcp", "local"])
@pytest.mark.parametrize("kinds", ["cuda->host", "host->cuda", "cuda->cuda", "read host->cuda"])
async def test_gpu_memory_moves(make_engine, protocol, kinds):
    torch = _torch()
    a = await make_engine(protocols=[protocol])
    b = await make_engine(protocols=[protocol])
    n = 6 << 20
    src_host = torch.randint(0, 256, (n,), dtype=torch.uint8)
    src = src_host.cuda() if kinds.startswith("cuda") else src_host
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda" if kinds.endswith("cuda") else "cpu")
    if kinds.startswith("read"):
        rs = b.register(src_host, name="src")
        rd = a.register(dst, name="dst")
        peer = await bounded(a.connect(b.address))
        await bounded(peer.read([rd.addr], [peer.region("src").addr], [n]))
    else:
        rs = a.register(src, name="src")
        rd = b.register(dst, name="dst")
        peer = await bounded(a.connect(b.address))
        offs = np.arange(64, dtype=np.uint64) * np.uint64(65536)
        await bounded(peer.write(rs.addr + offs, peer.region("dst").addr + offs, np.full(64, 65536, np.uint64)))
        await bounded(peer.write([rs.addr + (4 << 20)], [peer.region("dst").addr + (4 << 20)], [2 << 20]))
    torch.cuda.synchronize()
    assert _sha_tensor(dst) == _sha_tensor(src_host)


@gpu
def test_flag_write_kernel():
    from kvflow._cuda import driver, kernels
    pinned = driver.PinnedHost(4096)
    try:
        flag = np.frombuffer((ctypes.c_uint64 * 512).from_address(pinned.addr), dtype=np.uint64)
        flag[:] = 0
        stream = driver.Stream(0)
        kernels.flag_write(stream, pinned.addr + 8, 0xC0FFEE)
        with driver.on_device(0):
            driver.check(driver.driver().cuStreamSynchronize(stream.handle), "cuStreamSynchronize")
        assert int(flag[1]) == 0xC0FFEE and int(flag[0]) == 0
        stream.close()
    finally:
        pinned.close()


@gpu
def test_ipc_handle_opens_in_another_process():
    torch = _torch()
    from kvflow._cuda import driver
    t = torch.arange(4096, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    loc = driver.pointer_location(t.data_ptr())
    handle = driver.ipc_handle(loc.base, 0)
    assert len(handle) == driver.IPC_HANDLE_BYTES
    code = ("import sys, numpy as np\n"
            "from kvflow._cuda import driver as d\n"
            "base = d.ipc_open(bytes.fromhex(sys.argv[1]), 0)\n"
            "out = np.zeros(4096, np.int32)\n"
            "with d.on_device(0):\n"
            "    d.check(d.driver().cuMemcpyDtoH(out.ctypes.data, base + int(sys.argv[2]), out.nbytes), 'DtoH')\n"
            "print(int(out.sum()))\n"
            "d.ipc_close(base, 0)\n")
    out = subprocess.run([sys.executable, "-c", code, handle.hex(), str(t.data_ptr() - loc.base)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == sum(range(4096))


@gpu
def test_nixl_api_moves_vram():
    """kvflow.compat.nixl with torch CUDA tensors (VRAM), as vLLM's
    NixlConnector registers its KV caches: a write and a read, every byte."""
    torch = _torch()
    import uuid
    import time
    from kvflow.compat.nixl import nixl_agent, nixl_agent_config
    a = nixl_agent(f"a-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent(f"b-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
    assert a.register_memory(src) is not None and b.register_memory(dst) is not None
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.get_xfer_descs([(src.data_ptr() + i * 65536, 65536, 0) for i in range(64)], "VRAM")
    remote = a.get_xfer_descs([(dst.data_ptr() + i * 65536, 65536, 0) for i in range(64)], "VRAM")
    h = a.initialize_xfer("WRITE", local, remote, b.name, b"done")
    a.transfer(h)
    deadline = time.monotonic() + 60
    while a.check_xfer_state(h) == "PROC":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert a.check_xfer_state(h) == "DONE"
    torch.cuda.synchronize()
    assert _sha_tensor(dst) == _sha_tensor(src)


@gpu
async def test_a_kernel_puts_its_layer_from_the_device_through_the_proxy():
    """GPU-initiated puts, proxy mode (tools/gpu_put.py): kvf_layer_put
    computes kv = x @ w on the device, each block puts its rows from the
    device through its channel of the put ring, the PutProxy posts them to
    a tcp engine on this machine; every row lands equal to the host's
    product, every status is 0, and one put alone comes back in bounded
    time."""
    _torch()
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("gpu_put", os.path.join(root, "tools", "gpu_put.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_put"] = mod
    spec.loader.exec_module(mod)
    res = await asyncio.wait_for(mod.run(rows=512, rows_per_block=16, repeats=5), 120)
    assert res["verified"] and res["statuses"] == [0], res
    assert res["blocks"] == 32 and res["proxy"][0]["finished"] == 32 and res["proxy"][1]["finished"] == 5
    assert 0 < res["single_p50_us"] < 100_000


_GPU_MEMBER = """
import asyncio, sys, kvflow
async def main():
    async with kvflow.Engine("127.0.0.1:0", protocols=("tcp",),
                             relay=kvflow.RelayGroup("node0", 1, 1, directory=sys.argv[1], device=0)) as eng:
        print(eng.address, eng.relay_stats()["device_lanes"], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


@gpu
@pytest.mark.parametrize("member_in", ["this process", "its own process"])
@pytest.mark.parametrize("dst_kind", ["host", "cuda"])
async def test_gpu_batches_relay_through_device_lanes(make_engine, tmp_path, member_in, dst_kind):
    """A 48 MiB write from GPU memory to a destination on another rail goes
    through the member on that rail by its device lanes: each slot copied
    GPU to GPU (CUDA IPC when the member is another process), its doorbell
    written by the sender's stream; every byte lands, in host or GPU
    memory, and the sender's counters say every byte took the device lanes."""
    torch = _torch()
    d = str(tmp_path)
    member = None
    if member_in == "this process":
        m = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node0", 1, 1, directory=d, device=0))
        assert m.relay_stats()["device_lanes"] == 1
    else:
        member = subprocess.Popen([sys.executable, "-c", _GPU_MEMBER, d], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT}, text=True)
    try:
        if member is not None:
            line = await bounded(asyncio.get_running_loop().run_in_executor(None, member.stdout.readline), 60)
            assert line.split()[1:] == ["1"], f"the member process said {line!r}"
        sender = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node0", 0, 0, directory=d))
        dest = await make_engine(protocols=["tcp"], relay=kvflow.RelayGroup("node1", 1, 1, directory=d))
        n = 48 << 20
        host = torch.randint(0, 256, (n,), dtype=torch.uint8)
        src = host.cuda()
        pool = torch.zeros(n, dtype=torch.uint8, device="cuda" if dst_kind == "cuda" else "cpu")
        torch.cuda.synchronize()
        s = sender.register(src, name="src")
        dest.register(pool, name="kv")
        peer = await bounded(sender.connect(dest.address))
        dst = peer.region("kv").addr
        offs = np.arange(48, dtype=np.uint64) * np.uint64(1 << 20)
        await bounded(peer.write(s.addr + offs, dst + offs, np.full(48, 1 << 20, np.uint64)), 120)
        torch.cuda.synchronize()
        assert _sha_tensor(pool) == _sha_tensor(host)
        stats = sender.relay_stats()
        assert stats["device_lane_bytes"] == n and stats["relayed_bytes"] == n and stats["rerouted_bytes"] == 0
        await sender.close()        # its mapping of the member's device lanes closes before they are freed
    finally:
        if member is not None:
            member.stdin.close()
            member.wait(30)
