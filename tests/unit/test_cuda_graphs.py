"""What the CUDA-graph decode path decides on the host, tested without a GPU: batch buckets,
padding, the persistent buffers a step fills, the split count, and the backend choice."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.cuda_graphs import DecodeBuffers, bucket_for, capture_sizes, padded_decode_values
from cluster.engine.fused_inputs import build_fused_step, padded_rows
from cluster.engine.kernels.triton_support import (
    BackendUnavailableError,
    choose_decode_splits,
    resolve_attention_backend,
    triton_installed,
)

pytestmark = pytest.mark.unit


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(128) == (1, 2, 4) + tuple(range(8, 129, 8))
    assert capture_sizes(100)[-3:] == (88, 96, 100)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(2000)[-1] == 512, "the largest graph is capped; bigger steps run eagerly"


@pytest.mark.parametrize("rows, bucket", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (128, 128), (129, None)])
def test_bucket_is_the_smallest_size_that_holds_the_batch(rows, bucket):
    assert bucket_for(rows, capture_sizes(128)) == bucket


def test_padded_values_pad_each_column_and_keep_the_table_rows():
    values, width = padded_decode_values([11, 12, 13], [4, 20, 0], [68, 341, 16], [5, 21, 1],
                                         [[4], [21, 3], [1]], bucket=4)
    assert width == 2
    assert values == [
        11, 12, 13, 0,   # token ids, padding reads token 0
        4, 20, 0, 0,     # positions
        68, 341, 16, -1,  # slots: padding writes no KV
        5, 21, 1, 0,     # lengths: padding attends to nothing
        4, 0, 21, 3, 1, 0,  # block table of the real rows, padded to the widest
    ]
    with pytest.raises(ValueError, match="do not fit"):
        padded_decode_values([1, 2], [0, 0], [0, 1], [1, 1], [[0], [0]], bucket=1)


def test_buffers_take_a_step_in_place_and_keep_their_addresses():
    buffers = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buffers.input_ids, buffers.seq_lens, buffers.block_table)]
    buffers.fill([7, 8, 9], [40, 2, 17], [100, 5, 60], [41, 3, 18], [[6, 1, 9], [0], [3, 2]], bucket=4)
    assert buffers.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert buffers.positions[:4].tolist() == [40, 2, 17, 0]
    assert buffers.slot_mapping[:4].tolist() == [100, 5, 60, -1]
    assert buffers.seq_lens[:4].tolist() == [41, 3, 18, 0]
    assert buffers.block_table[0, :3].tolist() == [6, 1, 9]
    assert buffers.block_table[2, :2].tolist() == [3, 2]
    # A smaller next step overwrites its rows; the metadata views see the new values.
    buffers.fill([5], [3], [33], [4], [[2]], bucket=1)
    meta = buffers.metadata(bucket=1, decode_splits=2)
    assert meta.slot_mapping.tolist() == [33] and meta.fused.decode_seq_lens.tolist() == [4]
    assert meta.fused.decode_block_table.shape == (1, 4) and meta.fused.decode_block_table[0, 0] == 2
    assert meta.num_decodes == 1 and meta.fused.decode_splits == 2
    assert [t.data_ptr() for t in (buffers.input_ids, buffers.seq_lens, buffers.block_table)] == addresses
    with pytest.raises(ValueError, match="5 blocks"):
        buffers.fill([1], [0], [0], [80], [[0, 1, 2, 3, 4]], bucket=1)


def test_fused_step_lays_out_decodes_and_chunks():
    step = build_fused_step(
        input_ids=[5, 6, 7, 8, 9, 10], positions=[3, 0, 1, 2, 16, 17], slots=[19, 32, 33, 34, 80, 81],
        sample_rows=[0, 3, 5], decode_lens=[4], decode_block_table=[[1]],
        prefill_chunks=[(1, 3, 3, [2]), (4, 2, 18, [4, 5])], decode_splits=1, device=torch.device("cpu"),
    )
    assert step.input_ids.tolist() == [5, 6, 7, 8, 9, 10] and step.sample_rows.tolist() == [0, 3, 5]
    fused = step.fused
    assert fused.decode_seq_lens.tolist() == [4] and fused.decode_block_table.tolist() == [[1]]
    assert fused.prefill_query_starts.tolist() == [1, 4, 6]
    assert fused.prefill_context_lens.tolist() == [3, 18]
    assert fused.prefill_block_table.tolist() == [[2, 0], [4, 5]]
    assert fused.prefill_max_query_len == 3
    empty = build_fused_step([1], [0], [0], [0], [], [], [(0, 1, 1, [0])], 1, torch.device("cpu"))
    assert empty.fused.decode_block_table.shape == (0, 1) and empty.fused.prefill_block_table.tolist() == [[0]]
    assert padded_rows([]) == ([], 1)


@pytest.mark.parametrize("seqs, kv_heads, sms, longest, splits", [
    (1, 8, 132, None, 16),   # one request on an H100: split until the SMs are busy (capped)
    (8, 8, 132, None, 4),
    (64, 8, 132, None, 1),
    (1, 8, 132, 1024, 4),    # a known context caps the split at 256 keys a part
    (1, 8, 132, 100, 1),
    (3, 2, 1, None, 1),      # the CPU interpreter runs programs one at a time: no split
])
def test_decode_splits(seqs, kv_heads, sms, longest, splits):
    assert choose_decode_splits(seqs, kv_heads, sms, longest) == splits


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("torch", cuda) == "torch"
    assert resolve_attention_backend("auto", cuda) == ("triton" if triton_installed() else "torch")
    with pytest.raises(BackendUnavailableError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", cpu)


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if triton_installed():
        with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
            resolve_attention_backend("triton", torch.device("cpu"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_attention_backend("triton", torch.device("cpu")) == "triton"


def test_engine_config_names_bad_settings():
    with pytest.raises(EngineConfigError, match="attention_backend must be one of auto, torch, triton, got 'cuda'"):
        EngineConfig(model="m", attention_backend="cuda")
    with pytest.raises(EngineConfigError, match="load_format must be one of safetensors, dummy"):
        EngineConfig(model="m", load_format="pt")
    with pytest.raises(EngineConfigError, match="enforce_eager must be true or false"):
        EngineConfig(model="m", enforce_eager="yes")


def test_command_line_flags_reach_the_engine_config():
    from cluster.cli.main import _engine_args, build_parser

    default = _engine_args(build_parser().parse_args(["run", "--input", "-", "--output", "-"]))
    assert default["attention_backend"] == "auto" and default["enforce_eager"] is False
    args = build_parser().parse_args(["run", "--input", "-", "--output", "-", "--enforce-eager",
                                      "--attention-backend", "torch"])
    config = EngineConfig(model="m", **_engine_args(args))
    assert config.enforce_eager is True and config.attention_backend == "torch"
