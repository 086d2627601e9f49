"""How every benchmark writes its results: a CSV of the rows, a markdown report, and the command that reproduces it."""

from __future__ import annotations

import csv
from pathlib import Path


def write_results(
    out: Path, stem: str, rows: list[dict] | None, markdown: list[str], command: str, *, also: tuple[str, ...] = ()
) -> None:
    """Write ``out/stem.csv`` and ``out/stem.md``, print the report and the command that reproduces it.

    Args:
        rows: ``None`` when the benchmark writes its own tables (no ``stem.csv``).
        also: extensions of other files the benchmark wrote under the same stem (e.g. ``("png",)``), for the message.
    """
    out.mkdir(parents=True, exist_ok=True)
    # Every key of every row, in the order first seen: an arm that failed or was skipped has fewer fields.
    if rows is not None:
        fields = list(dict.fromkeys(key for row in rows for key in row))
        with open(out / f"{stem}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, restval="")
            writer.writeheader()
            writer.writerows(rows)
    (out / f"{stem}.md").write_text("\n".join(markdown) + "\n")
    print("\n".join(markdown))
    written = ("csv", "md", *also) if rows is not None else ("md", *also)
    print(f"\nwrote {out / stem}.{{{','.join(written)}}}\nreproduce: {command}")
