"""The staging copy of missed experts (--expert-misses copy), on the CPU through Triton's interpreter where Triton is
installed; the GPU run is in test_gpu_fast_path.py."""

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.random_blocks import random_blocks
from engine.pipeline.split_args import add_split_args, options_from_args


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)
def test_missed_experts_are_staged_and_hits_keep_their_slot() -> None:
    pytest.importorskip("triton")
    from engine.kernels.stage_copy import Stager

    e_n, k = 6, 3
    host = [
        [torch.from_numpy(random_blocks(QT.Q4_K, 16, 512, seed=10 * p + e)) for e in range(e_n)]
        for p in range(3)
    ]
    vram = {p: {e: host[p][e].clone() for e in (1, 4)} for p in range(3)}
    tables = torch.tensor(
        [
            [vram[p][e].data_ptr() if e in vram[p] else host[p][e].data_ptr() for e in range(e_n)]
            for p in range(3)
        ]
    )
    host_tables = torch.tensor([[host[p][e].data_ptr() for e in range(e_n)] for p in range(3)])
    nbytes = torch.tensor([host[p][0].numel() for p in range(3)])
    st = Stager(torch.device("cpu"), k, int(nbytes.max()))
    ids = torch.tensor([[4, 0, 5]])
    out = st.stage(ids, tables, host_tables, nbytes)
    for p in range(3):
        for j, e in enumerate(ids[0].tolist()):
            if e in vram[p]:
                assert out[p, j].item() == vram[p][e].data_ptr()
            else:
                assert out[p, j].item() == st.area[p, j].data_ptr()
                assert torch.equal(st.area[p, j, : host[p][e].numel()], host[p][e].reshape(-1))


def test_the_flag_reaches_the_policy() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    add_split_args(ap)
    assert options_from_args(ap.parse_args([])).expert_misses == "direct"
    assert options_from_args(ap.parse_args(["--expert-misses", "copy"])).expert_misses == "copy"
    with pytest.raises(SystemExit):
        ap.parse_args(["--expert-misses", "sometimes"])
