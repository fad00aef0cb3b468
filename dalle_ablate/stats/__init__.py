"""The statistics engine: numbers in, numbers out, over numpy arrays; it knows no run, study or page and has no words.
It imports numpy, scipy and the standard library only (pyproject.toml's contracts)."""
