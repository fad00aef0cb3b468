"""`python -m dalle_ablate.cli VERB ...` is the `dalle-ablate` command."""

from dalle_ablate.cli import main

if __name__ == "__main__":
    main()
