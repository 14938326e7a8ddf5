"""GGUF blocks repacked for the quantized kernels dequantize to exactly what ``gguf``'s own
dequantizer gives, bit for bit, for every type that is served quantized; rows and group-aligned
columns cut from a packed weight are the same rows and columns of the dequantized one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from cluster.engine.quantization.gguf_repack import REPACKERS, repack
from gguf_files import encode_tensor

pytestmark = pytest.mark.unit

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K]
ROWS, COLS = 10, 768


def test_every_served_type_has_a_repacker():
    assert set(REPACKERS) == set(TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_repacked_weights_dequantize_exactly_as_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = encode_tensor(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype, seed=int(qtype))
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(ROWS, COLS).astype(np.float32))
    packed = repack(raw, qtype)
    assert packed.shape == (ROWS, COLS)
    assert torch.equal(packed.dequantize(), expected)
    assert packed.bits_per_weight <= 10
    ids = torch.tensor([7, 0, 3])
    assert torch.equal(packed.dequantize_rows(ids), expected[ids])
    assert torch.equal(packed.row_slice(2, 5).dequantize(), expected[2:7])
    assert torch.equal(packed.col_slice(256, 512).dequantize(), expected[:, 256:768])
    with pytest.raises(ValueError, match="groups"):
        packed.col_slice(8, 256)
