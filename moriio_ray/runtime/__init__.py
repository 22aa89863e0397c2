"""The caller's runtime (``PDPipeline``, its flows, router and output streams), the coordinator actor,
and the protocol they share with the workers (``messages``, ``deadline``, ``detached``). The worker
actors themselves live in ``moriio_ray.worker``."""
