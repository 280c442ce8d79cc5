"""Console entry points (see setup.py)."""
