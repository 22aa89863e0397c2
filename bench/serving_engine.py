"""The serving benchmark's baseline: the bare Engine stepped in this process, fed its requests as
the pipeline's would arrive (closed loop, or Poisson arrivals)."""

from __future__ import annotations

import time
from typing import Any

from bench.common import (
    percentile,
)
from bench.http_client import Record
from bench.http_client import arrivals as poisson

Load = tuple[str, float]  # ("c", concurrency) or ("rate", requests/s)


class BareEngine:
    """The colocated config's engine, CUDA graphs captured, stepped in this process."""

    def __init__(self, args: dict[str, Any]) -> None:
        from moriio_ray import parse_pipeline_config
        from moriio_ray.engine.engine import Engine

        config = parse_pipeline_config(args)
        t0 = time.perf_counter()
        self.engine: Any = Engine(config.model, config.engine, role="colocated", cuda_graphs=True)
        self.engine.capture_graphs()  # as every GPU worker does before serving
        self.build_s, self.count = time.perf_counter() - t0, 0

    def _add(self, prompt: list[int], params: Any) -> str:
        self.count += 1
        self.engine.add_request(f"bench-{self.count}", prompt, params)
        return f"bench-{self.count}"

    def run(self, prompts: list[list[int]], load: Load, output_tokens: int, timeout_s: float) -> list[Record]:
        """Closed loop, or open loop at Poisson arrivals; each step's tokens stamped when it returns."""
        from moriio_ray.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
        at_s = poisson(len(prompts), load[1], 0) if load[0] == "rate" else None
        todo, inflight, records = list(enumerate(prompts))[::-1], dict[str, Record](), list[Record]()
        t0 = time.perf_counter()
        while todo or inflight:
            while todo and (
                len(inflight) < load[1] if at_s is None else at_s[todo[-1][0]] <= time.perf_counter() - t0
            ):
                index, prompt = todo.pop()
                inflight[self._add(prompt, params)] = Record(
                    index=index, sent_s=time.perf_counter(), status=200
                )
            if not inflight:
                assert at_s is not None
                time.sleep(max(0.0, at_s[todo[-1][0]] - (time.perf_counter() - t0)))
                continue
            outs = self.engine.step()
            now = time.perf_counter()  # the step returned its tokens on the host: the device is done
            for out in outs:
                if (rec := inflight.get(out.request_id)) is not None and out.new_token_ids:
                    rec.add_tokens(now, len(out.new_token_ids))
                if rec is not None and out.finished:
                    rec.done_s = now
                    records.append(inflight.pop(out.request_id))
            if inflight and now - (oldest := next(iter(inflight.values()))).sent_s > timeout_s:
                rid = next(iter(inflight))
                self.engine.abort(rid)
                oldest.error, oldest.done_s = f"not finished within {timeout_s} s", now
                records.append(inflight.pop(rid))
        return records

    def decode_only(self, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
        """Decode tok/s at a full batch: ``batch`` prompts prefilled (untimed), then only the steps in
        which every one of them decodes a token are timed (median of 3)."""
        from moriio_ray.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)
        rates = []
        for r in range(3):
            started: set[str] = set()  # requests past their prefill
            for i in range(batch):
                self._add([(i * 7 + j + r) % 256 for j in range(prompt_len)], params)
            decode_s, tokens, done = 0.0, 0, 0
            while self.engine.has_work():
                t0 = time.perf_counter()
                outs = self.engine.step()
                step_s = time.perf_counter() - t0
                ids = {o.request_id for o in outs}
                if (
                    len(ids) == batch
                    and ids <= started
                    and not any(o.finished for o in outs)
                    and done < steps
                ):
                    decode_s, done = decode_s + step_s, done + 1
                    tokens += sum(len(o.new_token_ids) for o in outs)
                started |= ids
            rates.append(tokens / decode_s if decode_s else 0.0)
        return {
            "batch": batch,
            "prompt_len": prompt_len,
            "decode_tok_s": percentile(rates, 0.5),
            "runs": rates,
        }

    def close(self) -> None:
        """Free the engine's memory, so that the pipelines' engines find the device empty."""
        import gc

        import torch

        device, self.engine = str(self.engine.device), None
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
