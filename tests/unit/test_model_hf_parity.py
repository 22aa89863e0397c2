"""The model's logits equal the ``transformers`` reference on the same random weights.

Each test writes an HF-format directory itself (``save_pretrained`` with safetensors, one case
sharded), loads it back through ``loader.py``, and compares prefill logits at every position, then
paged-decode logits for a few more tokens, against the reference model's full-sequence forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moriio_ray.config import EngineConfig, ModelConfig  # noqa: E402
from moriio_ray.engine.batch import Batch  # noqa: E402
from moriio_ray.engine.kv_cache import KVCache  # noqa: E402
from moriio_ray.engine.loader import load_model, model_args  # noqa: E402
from moriio_ray.engine.runner import ModelRunner  # noqa: E402
from moriio_ray.engine.sampling import SamplingParams  # noqa: E402
from moriio_ray.engine.sequence import Sequence, blocks_for  # noqa: E402

BLOCK = 4
SMALL = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
)  # fmt: skip

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope_scaling": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
}


def _write_hf(tmp: Path, case: str, dtype: torch.dtype, shard: bool = False) -> Any:
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**SMALL, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than HF's init, and non-trivial norms, for a sharper test
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.08)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="40KB" if shard else "10GB")
    return model.to(dtype)


def _ours(tmp: Path, dtype: torch.dtype) -> tuple[ModelRunner, Any]:
    config = ModelConfig(preset=None, path=str(tmp), dtype=str(dtype).removeprefix("torch."))
    model = load_model(config, torch.device("cpu"), dtype, max_model_len=128)
    engine_cfg = EngineConfig(device="cpu", block_size=BLOCK, num_blocks=64)
    cache = KVCache(model_args(config), engine_cfg, dtype, torch.device("cpu"))
    return ModelRunner(model, cache, torch.device("cpu")), model


BIG = 1 << 30


def _compare(
    tmp: Path, case: str, dtype: torch.dtype, atol: float, shard: bool = False, chunk: int = 0
) -> None:
    ref = _write_hf(tmp, case, dtype, shard)
    if shard:
        assert (tmp / "model.safetensors.index.json").exists() and len(list(tmp.glob("*.safetensors"))) > 2
    runner, model = _ours(tmp, dtype)
    gen = torch.Generator().manual_seed(3)
    lengths, extra = [1, BLOCK, 2 * BLOCK, BLOCK + 1, 13], 3
    full = [torch.randint(0, SMALL["vocab_size"], (n + extra,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        expected = [ref(torch.tensor([ids])).logits[0].float() for ids in full]  # [n + extra, V]
    # prefill (mixed lengths: padded + masked path), logits at every position
    seqs, free = [], list(range(63, -1, -1))
    for i, (n, ids) in enumerate(zip(lengths, full, strict=True)):
        seq = Sequence(f"s{i}", ids[:n], SamplingParams(), seed=0)
        seq.block_table = [free.pop() for _ in range(blocks_for(n + extra, BLOCK))][::-1]  # out of order
        seqs.append(seq)
    # prefill (mixed lengths: padded + masked path; or chunk by chunk, each chunk continuing the
    # cached prefix), logits at every position
    logits_of: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.inference_mode():
        while any(seq.num_cached < seq.num_prompt_tokens for seq in seqs):
            rows = [i for i, seq in enumerate(seqs) if seq.num_cached < seq.num_prompt_tokens]
            q_lens = [min(chunk or BIG, seqs[i].num_prompt_tokens - seqs[i].num_cached) for i in rows]
            ids, positions, meta, _ = runner.prepare(Batch([seqs[i] for i in rows], q_lens, 0))
            logits = model.compute_logits(model(ids, positions, runner.kv_cache.layers, meta))
            start = 0
            for i, n in zip(rows, q_lens, strict=True):
                logits_of[i].append(logits[start : start + n])
                seqs[i].num_cached += n
                start += n
    for seq, exp, got in zip(seqs, expected, logits_of, strict=True):
        n = seq.num_prompt_tokens
        assert len(got) == (-(-n // chunk) if chunk else 1)
        torch.testing.assert_close(torch.cat(got), exp[:n], atol=atol, rtol=0)
    # paged decode of the remaining tokens, one step at a time, all sequences batched
    for step in range(extra):
        for seq, ids in zip(seqs, full, strict=True):
            seq.output_ids.append(ids[seq.num_prompt_tokens + step])
        out = runner.run(Batch.decode(seqs))
        for row, seq, exp in zip(out, seqs, expected, strict=True):
            torch.testing.assert_close(row, exp[seq.num_cached], atol=atol, rtol=0)
            seq.num_cached += 1
    scale = max(e.abs().max().item() for e in expected)
    assert scale > 1.0, "reference logits are too flat to make this comparison meaningful"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_fp32(case: str, tmp_path: Path) -> None:
    _compare(tmp_path, case, torch.float32, atol=2e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_chunked_prefill_logits_match_transformers_fp32(case: str, tmp_path: Path) -> None:
    # chunks of 3 tokens: they split blocks of 4, and each continues a cached prefix
    _compare(tmp_path, case, torch.float32, atol=2e-4, chunk=3)


@pytest.mark.timeout(120)
def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    _compare(tmp_path, "llama", torch.float32, atol=2e-4, shard=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_logits_match_transformers_bf16(case: str, tmp_path: Path) -> None:
    # bfloat16 has 8 mantissa bits: logits of magnitude ~5 round at ~0.03; allow a few roundings
    _compare(tmp_path, case, torch.bfloat16, atol=0.25)
