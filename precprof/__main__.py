"""`python -m precprof` (also what `torchrun -m precprof train ...` runs)."""

from precprof.cli import main

if __name__ == "__main__":
    main()
