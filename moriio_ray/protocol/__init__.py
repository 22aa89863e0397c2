"""What the caller, the coordinator and the workers share, torch-free and Ray-free at import:
``messages`` (the structs they exchange), ``deadline`` (a bound on every remote await) and
``detached`` (calls sent outside the sending task's lineage)."""
