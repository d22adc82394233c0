"""`python -m trainer` / `torchrun -m trainer`: parse options and train."""
import sys

from trainer.train import main

sys.exit(main())
