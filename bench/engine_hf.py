"""The transformers baseline of the engine bench: the same weights in an HF model, run as the engine runs."""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch

from moriio_ray.engine.engine import Engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HF_SAME = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
)


HF_RENAMED = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
}


HF_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def hf_model(engine: Engine) -> Any:
    """The ``transformers`` model of the engine's architecture (random weights: speed does not
    depend on them), or None without ``transformers``."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()  # the cache-argument deprecation notices, once per step
    args, rope = engine.args, engine.args.rope
    rope_kw: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "llama3":
        names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope_kw |= {k: getattr(rope, k) for k in names}
    kw = {k: getattr(args, k) for k in HF_SAME} | {k: getattr(args, v) for k, v in HF_RENAMED.items()}
    config = getattr(transformers, HF_CONFIGS[args.model_type])(
        **kw, tie_word_embeddings=args.tie_word_embeddings, rope_parameters=rope_kw
    )
    with torch.device(engine.device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=engine.dtype).eval()


@torch.inference_mode()
def hf_run(
    model: Any, device: torch.device, batch: int, a: argparse.Namespace, seed: int
) -> dict[str, float]:
    """One forward over the engine's prompts, then greedy single-token forwards with its KV cache."""
    gen = torch.Generator().manual_seed(seed + 1000)
    ids = torch.randint(0, 256, (batch, a.prompt_len), generator=gen).to(device)
    sync(device)
    start = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    sync(device)
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(a.decode_steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
    sync(device)
    decode_s = time.perf_counter() - start
    rates = {
        "prefill_tok_s": batch * a.prompt_len / prefill_s,
        "decode_tok_s": batch * a.decode_steps / decode_s,
    }
    return {**rates, "prefill_s": prefill_s, "decode_step_ms": 1e3 * decode_s / a.decode_steps}
