"""What the caller, the coordinator and the workers share, torch-free and Ray-free at import:
``messages`` (the structs they exchange), ``membership`` (a view of the pool kept current by long
poll, and the packed answer), ``pool_state`` (the names and the GCS record that let a pool outlive
its coordinator's process), ``deadline`` (a bound on every remote await) and ``detached`` (calls
sent outside the sending task's lineage)."""
