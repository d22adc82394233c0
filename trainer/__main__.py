"""`python -m trainer` / `torchrun -m trainer`: parse options and train; `python -m trainer plot RUN`: plot a run."""
import sys

if sys.argv[1:2] == ["plot"]:
    from trainer.plot import main as plot_main

    sys.exit(plot_main(sys.argv[2:]))

from trainer.train import main

sys.exit(main())
