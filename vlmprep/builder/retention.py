"""`vlmprep gc DIR --keep N` (docs/datasets-that-grow.md): the versions to keep (the N newest, the latest always, and
every tagged one unless --no-keep-tag) and the files that only the others name, removed under the dataset's lock.

    catalog (records, tags; manifest.json repaired first) --plan_gc--> GcPlan (pure: the property tests' subject)
        --collect--> the removed versions' tags, then their files (shards, sample indexes), then their records

Never removed: a file any kept version names (the latest's included), any version's rejects and id files (every
later version's stats and the next append's duplicate check read them), a bucket's claims, anything of a version
above the latest (an append in flight). A kill midway leaves records naming files already gone: gc run again
finishes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vlmprep.builder.catalog import Catalog, CatalogError, dataset_files, read_catalog
from vlmprep_schemas.versions import tag_file, version_name


@dataclass(frozen=True)
class GcPlan:
    """What gc keeps and removes: the versions kept (each with why: latest, --keep, tag NAME), the versions removed,
    the data files and tag files removed, and the bytes of those files (as their records list them)."""

    kept: dict[int, str]
    removed: list[int]
    files: list[str]
    tags: list[str]
    bytes: int

    @property
    def records(self) -> list[str]:
        """The record files of the removed versions, oldest first: removed last."""
        return [version_name(n) for n in self.removed]


def plan_gc(catalog: Catalog, keep: int, *, keep_tags: bool = True) -> GcPlan:
    """The versions to keep: the `keep` newest (by number, of those present), the latest always, and each tagged one
    (`keep_tags`; without it a tagged version outside the window goes, and its tags with it, so no tag names a
    removed version). The files to remove: those a removed version's record names and no kept one does."""
    if keep < 1:
        raise CatalogError(f"--keep {keep}: keep at least the latest version (--keep 1)")
    numbers = sorted(catalog.records)
    kept = {n: "--keep" for n in numbers[-keep:]}
    kept[catalog.latest] = "latest"
    if keep_tags:
        for t in sorted(catalog.tags.values(), key=lambda t: t.tag):
            kept.setdefault(t.version, f"tag {t.tag}")
    removed = [n for n in numbers if n not in kept]
    named = set().union(*(catalog.records[n].names() for n in kept))
    sizes: dict[str, int] = {}
    for n in removed:
        m = catalog.records[n].manifest
        sizes.update({s.name: s.bytes for s in m.shards})
        sizes.update({s.index.name: s.index.bytes for s in m.shards if s.index})
        if m.sample_index:
            sizes[m.sample_index.name] = m.sample_index.bytes
    files = sorted(set(sizes) - named)
    assert not set(files) & catalog.records[catalog.latest].names(), "gc would remove a file of the latest version"
    tags = sorted(tag_file(t.tag) for t in catalog.tags.values() if t.version in removed)
    return GcPlan(dict(sorted(kept.items())), removed, files, tags, sum(sizes[f] for f in files))


def collect(
    value: str, keep: int, *, keep_tags: bool = True, dry_run: bool = False, say: Callable[[str], None] = print
) -> GcPlan:
    """`vlmprep gc DIR --keep N`: under the dataset's lock (a build, an append or a watch on it refused, or refusing
    this, in one line), manifest.json repaired where a kill left it behind, every record and tag read and checked (a
    corrupt one refused before anything is removed), then the plan's tags, files and records removed in that order;
    `dry_run`: nothing removed. Returns the plan."""
    files, ref = dataset_files(value)
    if ref is not None:
        raise CatalogError(f"{value}: gc takes the dataset, not a version: `vlmprep gc {files.where} --keep N`")
    with files.owned():
        if not dry_run:
            files.repair(say)
        catalog = read_catalog(files)
        plan = plan_gc(catalog, keep, keep_tags=keep_tags)
        if not dry_run and plan.removed:
            files.remove(plan.tags)
            files.remove(plan.files)
            files.remove(plan.records)
    return plan
