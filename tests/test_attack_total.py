"""Over every gc case of the attack suite that ran before this file (test_attack_gc.py,
test_attack_rebuild.py: catalog damage, replacement, forged records, rebuilds), gc deleted no
object that a trusted record references. Runs last of the attack files (alphabetical order)."""

from storekit import GC_CASES

import pytest


def test_gc_deleted_zero_referenced_objects_over_the_suite():
    if len(GC_CASES) < 10:
        pytest.skip(f"only {len(GC_CASES)} gc case(s) ran: run the attack files together")
    deleted = sum(n for _, n in GC_CASES)
    print(f"gc cases: {len(GC_CASES)}, objects a trusted record references that gc deleted: {deleted}")
    assert deleted == 0, GC_CASES
