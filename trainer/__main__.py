"""`python -m trainer` / `torchrun -m trainer` (or the installed `vlmprep-train`): parse options and train;
`... plot RUN`: plot a run; `... export RUN ...`: write a run's checkpoint as a transformers model dir
(trainer/export.py)."""

import sys


def main(argv: list[str] | None = None) -> int:
    """Command-line arguments (`sys.argv[1:]` by default) -> exit status: `plot ...` and `export ...` go to their
    tools, anything else is a training run (trainer/train.py main)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        from trainer.plot import main as plot_main

        return plot_main(argv[1:])
    if argv[:1] == ["export"]:
        from trainer.export import main as export_main

        return export_main(argv[1:])
    from trainer.train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
