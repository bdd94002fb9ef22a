import asyncio, numpy as np, pytest, kvflow, hashlib
from _batches import MiB, place, bounded, sha256
from _target import pattern
BIG = 66 * MiB
@pytest.mark.parametrize("provider", ["tcp"], indirect=True)
async def test_dbg(make_pair, local_mem):
    p = await make_pair(regions=[{"name": "rw", "length": BIG, "access": 3}])
    a = local_mem(p.eng, BIG); a.view[:] = pattern(1, BIG)
    b = local_mem(p.eng, BIG); b.view[:] = pattern(2, BIG)
    lengths = np.full(64, MiB, np.uint64)
    off = place(np.random.default_rng(3), lengths, BIG)
    raddrs = np.uint64(p.raddr("rw")) + off
    with pytest.raises(kvflow.TransferTimeoutError):
        await p.peer.write(np.uint64(a.addr) + off, raddrs, lengths, timeout=1e-6)
    await bounded(p.peer.write(np.uint64(b.addr) + off, raddrs, lengths), 60)
    for when in range(3):
        shas = await p.target.sha_many("rw", zip(off.tolist(), lengths.tolist()))
        for i, (o, n) in enumerate(zip(off.tolist(), lengths.tolist())):
            if shas[i] != sha256(b.view[o:o+n]):
                print(when, "entry", i, "is A:", shas[i] == sha256(a.view[o:o+n]), "is C3:", shas[i] == hashlib.sha256(b"\xc3"*n).hexdigest())
                got = await p.target.get("rw", o, 64); print(got[:16].hex(), a.view[o:o+16].tobytes().hex(), b.view[o:o+16].tobytes().hex())
        await asyncio.sleep(0.5)
