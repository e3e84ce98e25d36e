"""The static-shape decode step on CPU, tiny random Llama: equal to the eager step, padding in the pad block."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from services.gpu_worker.device_sampler import PAD_ROW
from services.gpu_worker.engine import resolve_decode_graphs
from services.gpu_worker.graphs import StaticDecoder
from services.gpu_worker.model import LlamaConfig, LlamaModel
from services.gpu_worker.plan import Segment

BT = 4
BLOCKS = 12
PAD = BLOCKS - 1


def tiny() -> LlamaModel:
    config = HFLlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    cpu = torch.device("cpu")
    return LlamaModel(LlamaConfig.from_hf(config), dict(hf.state_dict()), device=cpu, dtype=torch.float32)


def prefill(model: LlamaModel, cache: object, tables: list[list[int]], lengths: list[int]) -> None:
    segments = [Segment(list(range(1, n + 1)), 0, t) for t, n in zip(tables, lengths, strict=True)]
    model.forward(segments, cache)  # type: ignore[arg-type]


def test_the_static_step_equals_the_eager_step_and_padding_stays_in_the_pad_block() -> None:
    model = tiny()
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    lengths = [9, 5, 13]
    eager_cache = model.new_cache(BLOCKS, BT, torch.float32)
    static_cache = model.new_cache(BLOCKS, BT, torch.float32)
    for cache in (eager_cache, static_cache):
        prefill(model, cache, tables, lengths)
    decode = [Segment([7 + i], n, t) for i, (t, n) in enumerate(zip(tables, lengths, strict=True))]
    want = torch.cat(model.forward(decode, eager_cache)).argmax(-1).tolist()

    static = StaticDecoder(model, static_cache, max_batch=8, pad_block=PAD, max_context=PAD * BT, capture=True)
    assert not static.capture and static.buckets == [1, 2, 4, 8]  # no capture on CPU
    assert static.fits(decode)
    assert not static.fits([Segment([1, 2], 4, tables[0])])  # a prefill chunk is not a decode step
    assert not static.fits([Segment([1], 0, [0])] * 9)  # beyond the largest bucket
    before = [k.clone() for k in static_cache.k]
    got = static.step(decode, [PAD_ROW] * 3, [0, 0, 0])  # 3 rows: the 4-row bucket, one padding row
    assert got == want
    pad = slice(PAD * BT, (PAD + 1) * BT)
    for layer, (k_static, k_eager, k_before) in enumerate(zip(static_cache.k, eager_cache.k, before, strict=True)):
        torch.testing.assert_close(k_static[: PAD * BT], k_eager[: PAD * BT], msg=f"layer {layer}")
        changed = (k_static != k_before).any(-1).any(-1).nonzero().flatten().tolist()
        written = {t[n // BT] * BT + n % BT for t, n in zip(tables, lengths, strict=True)}
        assert set(changed) - written == {pad.start}  # the padding row wrote its K/V to the pad slot only


def test_the_decode_graphs_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode_graphs("auto", cpu, tp=False) == "off"  # the CPU keeps today's eager step
    assert resolve_decode_graphs("on", cpu, tp=False) == "static"  # the static step without capture
    assert resolve_decode_graphs("auto", cuda, tp=False) == "graphs"
    assert resolve_decode_graphs("on", cuda, tp=False) == "graphs"
    assert resolve_decode_graphs("on", cuda, tp=True) == "off"  # followers mirror the eager packed step
    assert resolve_decode_graphs("off", cuda, tp=False) == "off"
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_decode_graphs("yes", cpu, tp=False)
