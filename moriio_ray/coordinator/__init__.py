"""The coordinator's process: the actor that starts the workers (``actor``) and keeps the versioned
membership with the descriptors; ``changes``, the log of membership changes its long poll answers
from; ``liveness``, the death watch, pings and replacement of the dead; ``recovery``, taking the
pool back after a restart; ``engine_group`` places a tensor-parallel engine's rank actors. It
loads no torch: the worker actor class is built from a module whose heavy parts load in the
worker's own process."""
