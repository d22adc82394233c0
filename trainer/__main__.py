"""`python -m trainer` / `torchrun -m trainer`: parse options and train; `python -m trainer plot RUN`: plot a run;
`python -m trainer export RUN ...`: write a run's checkpoint as a transformers model dir (trainer/export.py)."""
import sys

if sys.argv[1:2] == ["plot"]:
    from trainer.plot import main as plot_main

    sys.exit(plot_main(sys.argv[2:]))
if sys.argv[1:2] == ["export"]:
    from trainer.export import main as export_main

    sys.exit(export_main(sys.argv[2:]))

from trainer.train import main

sys.exit(main())
