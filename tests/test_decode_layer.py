"""``_kernels.DecodeLayer``, the native front of a decode layer: bad arguments are refused
with ``KernelError`` before anything is written (its results are compared with the modules'
in ``tests/test_decode_path.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.errors import KernelError
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("decode-layer") / "m", "qwen3", vocab_size=256)
    runner = ModelRunner.from_pretrained(folder, ExecutorConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=8,
                                                                 attention_backend="sdpa"))
    program = runner.model.decode_path.layers[0]
    assert program.native is not None
    return program


def _arguments(program, slots=(3,)):
    rows, hidden = len(slots), program.input_norm.weight.shape[0]
    head_dim, kv_heads = program.head_dim, program.num_kv_heads
    cache = np.zeros((4, 16, kv_heads, head_dim), dtype=np.float32)
    return dict(
        gate_up=np.zeros((rows, program.gate_up.product.out_features), dtype=np.float32),
        residual=np.empty((rows, hidden), dtype=np.float32),
        hidden=np.random.default_rng(0).standard_normal((rows, hidden)).astype(np.float32),
        first=True,
        cos=np.ones((rows, head_dim), dtype=np.float32),
        sin=np.zeros((rows, head_dim), dtype=np.float32),
        key_cache=cache,
        value_cache=cache.copy(),
        slots=np.asarray(slots, dtype=np.int64),
        block_tables=np.zeros((rows, 4), dtype=np.int32),
        seq_lens=np.full(rows, 4, dtype=np.int32),
    )


def test_a_step_writes_its_row_s_key_and_value_and_nothing_else(layer):
    args = _arguments(layer)
    layer.native.run(**args, num_threads=torch.get_num_threads())
    for cache in (args["key_cache"], args["value_cache"]):
        written = np.abs(cache).reshape(-1, cache.shape[2] * cache.shape[3]).sum(axis=1) > 0
        assert written.nonzero()[0].tolist() == [3]  # slot 3 only
    # The residual stream is the input plus the attention block's output.
    assert np.isfinite(args["residual"]).all() and not np.array_equal(args["residual"], args["hidden"])
    assert np.isfinite(args["gate_up"]).all()


BAD = ["slot", "cache_shape", "aliased", "rows", "block_id", "context", "sin", "table_rows"]


@pytest.mark.parametrize("bad", BAD)
def test_bad_arguments_are_refused_before_anything_is_written(layer, bad):
    args = _arguments(layer)
    args["first"] = False  # a refused call must not have added into the residual stream either
    args["residual"][:] = 1.0
    if bad == "slot":
        args["slots"] = np.array([64], dtype=np.int64)  # 4 blocks of 16 slots
    elif bad == "cache_shape":
        args["value_cache"] = np.zeros((4, 16, layer.num_kv_heads + 1, layer.head_dim), dtype=np.float32)
    elif bad == "aliased":
        # a view of another argument (numpy's borrow checking refuses it as the call's
        # arguments are converted, a TypeError)
        args["residual"] = args["gate_up"].reshape(-1)[: args["hidden"].size].reshape(args["hidden"].shape)
    elif bad == "rows":
        args["seq_lens"] = np.full(2, 4, dtype=np.int32)  # two rows' contexts for one row
    elif bad == "block_id":
        args["block_tables"][0, 0] = 4  # the caches hold blocks 0..3 (attention's own check)
    elif bad == "context":
        args["seq_lens"][0] = 65  # past the row's 4 blocks of 16 (attention's own check)
    elif bad == "sin":
        args["sin"] = np.zeros((1, layer.head_dim // 2), dtype=np.float32)  # the rotary kernel's check
    else:
        args["block_tables"] = np.zeros((2, 4), dtype=np.int32)  # tables for two rows, one row
    before = {name: args[name].copy() for name in ("key_cache", "value_cache", "residual", "gate_up")}
    with pytest.raises(TypeError if bad == "aliased" else KernelError):
        layer.native.run(**args)
    for name, array in before.items():
        assert np.array_equal(args[name], array, equal_nan=True), name
