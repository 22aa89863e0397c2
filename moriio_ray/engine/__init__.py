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
- ``sim_model``: the simulated model (``model.preset: sim``), whose steps wait on a virtual GPU's
  timeline over a real KV cache, to show the runtime's own cost on the CPU
- ``kv_cache``, ``block_allocator``: the paged cache and its reference-counted, leased blocks
- ``fused_forward``, ``triton_attention``, ``triton_fused``: the CUDA forward with Triton kernels
- ``pd_role``, ``admission``: the P/D hand-over (reservations, leases, the layer hook); what an
  engine checks before it takes a request
- ``prefix_cache``: block keys and the cached blocks
- ``sampling``, ``sampler``, ``shaping``, ``grammar``, ``stopping``, ``outputs``: request params,
  sampling on the device, penalties and bias, structured output, stop rules, step outputs
- ``tokenizer``, ``chat_template``, ``model_path``: tokenizers, chat templates, what ``model.path`` names
- ``gguf_file``, ``gguf_arch``, ``gguf_dequant``, ``gguf_loader``, ``gguf_tokenizer``, ``weight_sink``:
  GGUF files and checkpoint tensors into the model's parameters
- ``tp``, ``tp_size``, ``tp_shard``, ``tp_steps``, ``rank``: tensor parallelism (groups, sizes,
  slices, rank 0's step messages, the other ranks' shards)

docs/code_map.md has one line per module.
"""
