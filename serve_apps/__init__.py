"""Import paths for ``serve run``: each module exposes an application builder named ``app``."""
