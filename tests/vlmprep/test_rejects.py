"""The reject-reason registry (vlmprep/rejects.py) and the tables keyed by its reasons."""

from vlmprep.rejects import REASONS
from vlmprep.shards.summary import REJECT_FIXES


def test_every_reject_fix_names_a_registered_reason():
    # A renamed or dropped reason would leave its fix line behind, never printed again and never flagged.
    unknown = sorted(set(REJECT_FIXES) - set(REASONS))
    assert not unknown, f"REJECT_FIXES (vlmprep/shards/summary.py) keys not in vlmprep/rejects.py REASONS: {unknown}"
