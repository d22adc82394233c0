"""`python -m trainer` / `torchrun -m trainer`: parse options and train; `python -m trainer export RUN ...`: write a
run's checkpoint as a transformers model dir (trainer/export.py)."""
import sys

if sys.argv[1:2] == ["export"]:
    from trainer.export import main as export_main

    sys.exit(export_main(sys.argv[2:]))

from trainer.train import main

sys.exit(main())
