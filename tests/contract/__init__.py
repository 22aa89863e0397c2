"""The backend contract suite: ``harness.py`` (what a backend provides) and ``suite.py`` (the tests)."""
