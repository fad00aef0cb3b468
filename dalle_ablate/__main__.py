"""`python -m dalle_ablate VERB ...` is the `dalle-ablate` command (describe, plan, eval, report,
...); `python -m dalle_ablate.job [overrides]` is `python run.py`."""

from dalle_ablate.cli import main

if __name__ == "__main__":
    main()
