"""The worker's side: one process per engine (a Ray actor), never imported by the caller.

- ``actor``: ``EngineWorker`` and its Ray actor shell: lifecycle, health, stats; the role methods
  delegate to the parts below
- ``core``: engine, agent, engine loop, peers, request table, output streams; aborts
- ``prefill``, ``decode``: P's and D's parts (READ and WRITE)
- ``engine_loop``: the engine thread; ``outputs``: per-caller output streams
- ``requests``: one record per request; ``push``: WRITE's layer
  pushes; ``peers``: descriptors by key and epoch, connected once per pair
- ``pool_watch``: this worker's membership long poll (peers learned, dead ones dropped)
- ``quarantine``: D's blocks that a late read or push may still write, held until it has ended
- ``ranks``: rank 0's driver of a tensor-parallel engine's other ranks; ``rank_actor``: those
  ranks (``RankWorker``); ``tp_transfer``: a read per (D rank, P rank) pair
"""
