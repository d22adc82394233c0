"""The merged dataset's checks, run by build and `vlmprep merge` after the merge: the reject share
(--max-reject-fraction, --allow-empty) and the turn coverage (--min-turn-coverage). A failure is a RejectsError (the
dataset is complete: its summary is printed, then exit 1) and leaves DIR/build-failed.txt holding its line.
"""

from __future__ import annotations

from pathlib import Path

from vlmprep.builder.workers import BuildError
from vlmprep.shards.dataset import FAILED_NAME, REJECTS_NAME, write_text_atomic
from vlmprep.shards.manifest import Manifest
from vlmprep.shards.summary import coverage_problem, reject_fix, reject_share, rejected_records
from vlmprep.types import ManifestError


class RejectsError(BuildError, ManifestError):
    """A complete dataset (manifest and rejects.jsonl written) that rejected too much: exit 1 after its summary."""


_ACCEPT_REJECTS = "--max-reject-fraction 1 accepts it"


def check_rejects(
    manifest: Manifest, out: Path, *, allow_empty: bool, max_reject_fraction: float, rejects_file: str = REJECTS_NAME
) -> None:
    """After the whole dataset is merged: 0 samples (unless allow_empty) or a reject share over max_reject_fraction
    is an error naming the top reasons and the fix for the first. Complete either way: the files stay to look at.
    `rejects_file`: where the rejects are (an append's version has its own)."""
    out, t, rejects = Path(out), manifest.totals, manifest.rejects
    ranked = sorted(rejects.items(), key=lambda x: (-x[1], x[0]))
    fix = f"; fix: {reject_fix(ranked[0][0], manifest)}" if ranked else ""
    if t["samples"] == 0:
        if allow_empty:
            return
        why = ", ".join(f"{r} {n}" for r, n in ranked) or "no records"
        raise RejectsError(
            f"{out}: 0 samples written from {t['records']} records ({why}); see "
            f"{out / rejects_file}, or pass --allow-empty{fix}",
            manifest,
        )
    if reject_share(manifest) > max_reject_fraction:
        why = ", ".join(f"{r} {n}" for r, n in ranked[:3]) + (", ..." if len(ranked) > 3 else "")
        raise RejectsError(
            f"{out}: rejected {rejected_records(manifest)} of {t['records']} records "
            f"({reject_share(manifest):.1%} > "
            f"--max-reject-fraction {max_reject_fraction:g}: {why}){fix}; the dataset is written: "
            f"{_ACCEPT_REJECTS}",
            manifest,
        )


def check_coverage(manifest: Manifest, out: Path, *, min_turn_coverage: float) -> None:
    """After the whole dataset is merged: fewer trained turns than min_turn_coverage of those to train (the rest lost
    to --seq-len) is an error naming the share, the loss by reason and the fix. The files stay, as for rejects."""
    problem = coverage_problem(manifest, min_turn_coverage)
    if problem is not None:
        raise RejectsError(
            f"{Path(out)}: {problem}; the dataset is written: --min-turn-coverage 0 accepts it", manifest
        )


def check_dataset(
    manifest: Manifest,
    out: Path,
    *,
    allow_empty: bool,
    max_reject_fraction: float,
    min_turn_coverage: float,
    rejects_file: str = REJECTS_NAME,
) -> None:
    """Both checks of a merged dataset (build and `vlmprep merge`; an append's: of its new inputs, `rejects_file`
    naming their rejects); a failure leaves DIR/build-failed.txt holding its line, so that the build's own fix line
    rebuilds the dir without --overwrite (check_out) or commits the append; a pass removes it."""
    out = Path(out)
    try:
        try:
            check_rejects(
                manifest,
                out,
                allow_empty=allow_empty,
                max_reject_fraction=max_reject_fraction,
                rejects_file=rejects_file,
            )
        except RejectsError as e:
            if coverage_problem(manifest, min_turn_coverage) is None or not str(e).endswith(_ACCEPT_REJECTS):
                raise
            # The rejected records' turns fail the turn coverage too: accepting the rejects takes both options.
            raise RejectsError(
                f"{str(e)[: -len(_ACCEPT_REJECTS)]}--max-reject-fraction 1 --min-turn-coverage 0 accepts it", manifest
            ) from None
        if manifest.totals["samples"] or not allow_empty:  # --allow-empty accepts a build that rejected all
            check_coverage(manifest, out, min_turn_coverage=min_turn_coverage)
    except RejectsError as e:
        write_text_atomic(out / FAILED_NAME, f"{e}\n")
        raise
    (out / FAILED_NAME).unlink(missing_ok=True)
