"""The coordinator's process: the actor that starts the workers (``actor``), keeps the versioned
membership and the descriptors, pings the workers and replaces dead ones; ``engine_group`` places a
tensor-parallel engine's rank actors. It loads no torch: the worker actor class is built from a
module whose heavy parts load in the worker's own process."""
