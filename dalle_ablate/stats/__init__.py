"""The statistics engine: numbers in, numbers out, over numpy arrays -- the basic tests and
intervals (basic), the verdicts of paired comparisons (verdicts), the two-stage arithmetic
(stages), stage 2's allocation (allocation), and the simulations that calibrate them
(calibration, efficiency). It knows no run, study or page, and has no words: report/prose.py says
its outcomes. It imports numpy, scipy and the standard library only (pyproject.toml's contracts)."""
