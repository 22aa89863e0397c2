"""The built-in engine: a Llama/Qwen-family decoder over a paged KV cache with continuous batching.

Modules, one noun each (import them by full path; this package imports nothing, so that
``moriio_ray.engine.sampling.SamplingParams`` loads without torch):

- ``engine``: ``Engine``, the step loop and the prefill / decode / colocated roles
- ``stepping``: launching a step (forward, device-side sampling) and reading it back (overlap)
- ``scheduler``, ``batch``, ``sequence``: chunked prefill and mixed steps, a step's rows, per-request state
- ``runner``, ``inputs``, ``cuda_graph``: model inputs per step, and CUDA-graph replay of decode steps
- ``model``, ``layers``, ``arch``: the decoder, its blocks, ModelArgs
- ``attention``, ``attention_prefill``: paged attention of a mixed batch (the kernel interface)
- ``loader``, ``presets``, ``device``: weights from a local HF directory or seeded presets
- ``kv_cache``, ``block_allocator``: the paged cache and its reference-counted, leased blocks
- ``sampling``, ``sampler``, ``stopping``, ``outputs``, ``tokenizer``
"""
