"""IBGDA's device code (kvflow/_cuda/ibgda.cuh) on the host, against
rdma-core's own mlx5 definitions (infiniband/mlx5dv.h): the RDMA write WQE
byte for byte against mlx5dv_set_ctrl_seg / mlx5dv_set_data_seg and
struct mlx5_wqe_raddr_seg, the doorbell record and BlueFlame store of a
post, CQE parsing against struct mlx5_cqe64 and mlx5dv_get_cqe_opcode /
_owner across a wrap of the CQ, and the O(log n) region lookup against a
linear scan. It has never run on an mlx5 NIC: none is here."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLX5DV = "/usr/include/infiniband/mlx5dv.h"

_PROGRAM = r"""
#include <endian.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/mlx5dv.h>
#include "ibgda.cuh"

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { failures++; printf("FAIL %s:%d: ", __FILE__, __LINE__); \
    printf(__VA_ARGS__); printf("\n"); } } while (0)

static void wqe_against_rdma_core(uint16_t pi, uint32_t qpn, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                                  uint32_t rkey, uint32_t len, int signalled)
{
    uint8_t ours[64], theirs[64];
    memset(ours, 0xee, sizeof ours);
    memset(theirs, 0xee, sizeof theirs);
    kvf_ibgda_write_wqe(ours, pi, qpn, laddr, lkey, raddr, rkey, len, signalled);
    struct mlx5_wqe_ctrl_seg *ctrl = (struct mlx5_wqe_ctrl_seg *)theirs;
    struct mlx5_wqe_raddr_seg *rseg = (struct mlx5_wqe_raddr_seg *)(theirs + sizeof *ctrl);
    struct mlx5_wqe_data_seg *dseg = (struct mlx5_wqe_data_seg *)(theirs + sizeof *ctrl + sizeof *rseg);
    ctrl->dci_stream_channel_id = 0;
    mlx5dv_set_ctrl_seg(ctrl, pi, MLX5_OPCODE_RDMA_WRITE, 0, qpn, signalled ? MLX5_WQE_CTRL_CQ_UPDATE : 0,
                        KVF_IBGDA_WRITE_DS, 0, 0);
    rseg->raddr = htobe64(raddr);
    rseg->rkey = htobe32(rkey);
    rseg->reserved = 0;
    mlx5dv_set_data_seg(dseg, len, lkey, laddr);
    CHECK(memcmp(ours, theirs, 64) == 0, "WQE pi=%u qpn=%#x len=%u differs from rdma-core's", pi, qpn, len);
}

int main(void)
{
    /* the constants and sizes ibgda.cuh relies on */
    CHECK(KVF_MLX5_OPCODE_RDMA_WRITE == MLX5_OPCODE_RDMA_WRITE, "opcode");
    CHECK(KVF_MLX5_OPCODE_RDMA_READ == MLX5_OPCODE_RDMA_READ, "read opcode");
    CHECK(KVF_MLX5_WQE_CTRL_CQ_UPDATE == MLX5_WQE_CTRL_CQ_UPDATE, "cq update");
    CHECK(KVF_MLX5_SEND_WQE_BB == MLX5_SEND_WQE_BB, "basic block");
    CHECK(KVF_MLX5_SND_DBR == MLX5_SND_DBR, "send doorbell record index");
    CHECK(KVF_MLX5_CQE_REQ == MLX5_CQE_REQ && KVF_MLX5_CQE_REQ_ERR == MLX5_CQE_REQ_ERR, "cqe opcodes");
    CHECK(KVF_MLX5_CQE_INVALID == MLX5_CQE_INVALID, "invalid cqe opcode");
    CHECK(sizeof(struct mlx5_wqe_ctrl_seg) + sizeof(struct mlx5_wqe_raddr_seg) + sizeof(struct mlx5_wqe_data_seg)
          == 16 * KVF_IBGDA_WRITE_DS, "ds");
    CHECK(sizeof(struct mlx5_cqe64) == 64 && offsetof(struct mlx5_cqe64, wqe_counter) == 60 &&
          offsetof(struct mlx5_cqe64, op_own) == 63, "cqe64 layout");

    /* WQEs: edge values and a sweep */
    wqe_against_rdma_core(0, 0x1, 0x1000, 0x11, 0x2000, 0x22, 4096, 1);
    wqe_against_rdma_core(0xffff, 0xffffff, ~0ULL, 0xffffffffu, ~0ULL - 7, 0xfffffffeu, 0x80000000u, 0);
    srand(7);
    for (int i = 0; i < 10000; i++) {
        uint64_t la = ((uint64_t)rand() << 33) ^ ((uint64_t)rand() << 2), ra = ((uint64_t)rand() << 31) ^ rand();
        wqe_against_rdma_core((uint16_t)rand(), (uint32_t)rand() & 0xffffff, la, (uint32_t)rand(), ra,
                              (uint32_t)rand(), (uint32_t)rand(), rand() & 1);
    }

    /* a post: the WQE in the right basic block, the doorbell record, the BlueFlame store */
    static uint8_t sq[8 * 64] __attribute__((aligned(64)));
    static uint8_t cq[4 * 64] __attribute__((aligned(64)));
    uint32_t dbrec[2] = {0, 0}, cq_dbrec[2] = {0, 0};
    uint64_t bf = 0;
    struct kvf_ibgda_qp qp = {sq, dbrec, &bf, cq, cq_dbrec, 8, 0x1234, 4, 0, 0, 0};
    for (uint32_t n = 0; n < 20; n++) {
        uint32_t pi = kvf_ibgda_post_write(&qp, 0x10000 + n, 7, 0x90000 + n, 9, 64 + n);
        CHECK(pi == n, "producer index %u", pi);
        uint8_t *wqe = sq + (n % 8) * 64;
        struct mlx5_wqe_ctrl_seg *ctrl = (struct mlx5_wqe_ctrl_seg *)wqe;
        CHECK(be32toh(ctrl->opmod_idx_opcode) == ((n << 8) | MLX5_OPCODE_RDMA_WRITE), "ctrl of WQE %u", n);
        CHECK(be32toh(ctrl->qpn_ds) == ((0x1234u << 8) | 3), "qpn_ds");
        CHECK(ctrl->fm_ce_se == MLX5_WQE_CTRL_CQ_UPDATE, "signalled");
        CHECK(be32toh(dbrec[MLX5_SND_DBR]) == n + 1 && dbrec[MLX5_RCV_DBR] == 0, "doorbell record after %u", n);
        uint64_t first;
        memcpy(&first, wqe, 8);
        CHECK(bf == first, "BlueFlame got the ctrl segment's first 8 bytes");
        struct mlx5_wqe_data_seg *d = (struct mlx5_wqe_data_seg *)(wqe + 32);
        CHECK(be64toh(d->addr) == 0x10000 + n && be32toh(d->byte_count) == 64 + n && be32toh(d->lkey) == 7, "data");
    }

    /* the CQ: as the NIC writes it (owner bit flips each pass), across three passes of 4 entries */
    for (int i = 0; i < 4; i++)
        ((struct mlx5_cqe64 *)cq)[i].op_own = (MLX5_CQE_INVALID << 4) | 1;   /* how rdma-core initialises it */
    uint16_t counter = 0;
    CHECK(kvf_ibgda_poll_cq(&qp, &counter) == -1, "an empty CQ has nothing");
    for (uint32_t n = 0; n < 12; n++) {
        struct mlx5_cqe64 *e = (struct mlx5_cqe64 *)cq + (n % 4);
        e->wqe_counter = htobe16((uint16_t)(n * 3));
        uint8_t opcode = n == 5 ? MLX5_CQE_REQ_ERR : MLX5_CQE_REQ;
        e->op_own = (uint8_t)((opcode << 4) | ((n / 4) & 1));
        CHECK(mlx5dv_get_cqe_opcode(e) == opcode && mlx5dv_get_cqe_owner(e) == ((n / 4) & 1), "rdma-core reads it");
        int got = kvf_ibgda_poll_cq(&qp, &counter);
        CHECK(got == opcode && counter == n * 3, "CQE %u: opcode %d counter %u", n, got, counter);
        CHECK(be32toh(cq_dbrec[0]) == n + 1, "CQ doorbell record %u", be32toh(cq_dbrec[0]));
        CHECK(kvf_ibgda_poll_cq(&qp, &counter) == -1, "the next entry (old owner) is not new");
    }

    /* region lookup: O(log n) against a linear scan */
    enum { N = 1000 };
    static struct kvf_mr mrs[N];
    uint64_t at = 4096;
    for (int i = 0; i < N; i++) {
        at += (uint64_t)(rand() % 3) * 4096;                /* gaps between some regions */
        mrs[i].addr = at;
        mrs[i].length = 4096 * (1 + rand() % 8);
        mrs[i].lkey = 100 + i;
        mrs[i].rkey = 200 + i;
        at += mrs[i].length;
    }
    for (int k = 0; k < 100000; k++) {
        uint64_t a = 4096 + (uint64_t)rand() % (at + 8192), len = 1 + rand() % 20000;
        int linear = -1;
        for (int i = 0; i < N; i++)
            if (a >= mrs[i].addr && a + len <= mrs[i].addr + mrs[i].length) { linear = i; break; }
        CHECK(kvf_mr_lookup(mrs, N, a, len) == linear, "lookup of %#lx+%lu", (unsigned long)a, (unsigned long)len);
    }
    CHECK(kvf_mr_lookup(mrs, N, 0, 1) == -1 && kvf_mr_lookup(mrs, 0, 4096, 1) == -1, "below and empty");
    CHECK(kvf_mr_lookup(mrs, N, mrs[3].addr, mrs[3].length) == 3, "a whole region");
    CHECK(kvf_mr_lookup(mrs, N, mrs[3].addr + mrs[3].length - 1, 2) != 3, "one byte past it");
    printf("%d failures\n", failures);
    return failures != 0;
}
"""


@pytest.mark.skipif(not os.path.exists(MLX5DV) or shutil.which("gcc") is None,
                    reason="needs gcc and rdma-core's infiniband/mlx5dv.h (libibverbs-dev)")
def test_ibgda_layouts_agree_with_rdma_core(tmp_path):
    src, exe = tmp_path / "ibgda_check.c", tmp_path / "ibgda_check"
    src.write_text(_PROGRAM)
    build = subprocess.run(["gcc", "-O1", "-Wall", "-Werror", "-Wno-unused-function", "-I",
                            os.path.join(ROOT, "kvflow", "_cuda"), "-o", str(exe), str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failures"), run.stdout[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_ibgda_device_code_builds_into_the_fatbin():
    from kvflow._cuda import FATBIN, built
    if not built():
        pytest.skip("kvflow was built without its CUDA module")
    image = open(FATBIN, "rb").read()
    assert b"kvf_ibgda_write" in image


_LAYOUT = r"""
#include <stddef.h>
#include <stdio.h>
#include "ibgda.cuh"
#define F(s, f) printf("%s.%s %zu %zu\n", #s, #f, offsetof(struct s, f), sizeof(((struct s *)0)->f))
int main(void)
{
    F(kvf_ibgda_qp, sq_buf); F(kvf_ibgda_qp, dbrec); F(kvf_ibgda_qp, bf_reg); F(kvf_ibgda_qp, cq_buf);
    F(kvf_ibgda_qp, cq_dbrec); F(kvf_ibgda_qp, wqe_cnt); F(kvf_ibgda_qp, qpn); F(kvf_ibgda_qp, cqe_cnt);
    F(kvf_ibgda_qp, pad); F(kvf_ibgda_qp, sq_pi); F(kvf_ibgda_qp, cq_ci);
    F(kvf_mr, addr); F(kvf_mr, length); F(kvf_mr, lkey); F(kvf_mr, rkey);
    printf("kvf_ibgda_qp %zu\nkvf_mr %zu\n", sizeof(struct kvf_ibgda_qp), sizeof(struct kvf_mr));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_launchers_structs_match_the_device_codes(tmp_path):
    """What the host launcher uploads (kvflow.gpu.ibgda.QP_DTYPE, the
    provider's MR_DTYPE) has the offsets and sizes ibgda.cuh reads, as the
    C compiler lays them out."""
    from kvflow.gpu.ibgda import QP_DTYPE
    from kvflow.providers.rdma.ibgda import MR_DTYPE
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(_LAYOUT)
    build = subprocess.run(["gcc", "-Wall", "-Werror", "-Wno-unused-function", "-I",
                            os.path.join(ROOT, "kvflow", "_cuda"), "-o", str(exe), str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    sizes = dict(line.split() for line in lines if line.count(" ") == 1)
    assert int(sizes["kvf_ibgda_qp"]) == QP_DTYPE.itemsize and int(sizes["kvf_mr"]) == MR_DTYPE.itemsize
    fields = [line.split() for line in lines if line.count(" ") == 2]
    assert len(fields) == len(QP_DTYPE.names) + len(MR_DTYPE.names)
    for name, off, size in fields:
        struct, field = name.split(".")
        dt = QP_DTYPE if struct == "kvf_ibgda_qp" else MR_DTYPE
        assert dt.fields[field][1] == int(off) and dt.fields[field][0].itemsize == int(size), name


def test_page_spans_cover_every_range_once():
    from kvflow.gpu.ibgda import PAGE, page_spans
    assert page_spans([]) == []
    assert page_spans([(PAGE + 8, 8)]) == [(PAGE, PAGE)]
    # the send queue and the doorbell record on one page, the CQ two pages on
    assert page_spans([(0x10000, 2 * PAGE), (0x10000 + 2 * PAGE + 64, 8), (0x10000 + 4 * PAGE, 100)]) == \
        [(0x10000, 3 * PAGE), (0x10000 + 4 * PAGE, PAGE)]
    # overlapping and touching ranges merge; a range across a page edge takes both pages
    assert page_spans([(3 * PAGE - 4, 8), (PAGE, PAGE)]) == [(PAGE, 3 * PAGE)]
    assert page_spans([(PAGE, 0)]) == []
