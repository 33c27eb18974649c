"""What every probe ends with: a plain-text summary table, JSON for machines, and a progress bar while it runs."""
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from tqdm import tqdm


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as an aligned text table; columns default to the first row's keys."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def emit(title: str, rows: list[dict], result: dict, json_path: str | None, columns: list[str] | None = None,
         more: tuple[tuple[str, list[dict]], ...] = ()):
    """Print the summary table (and any `more` (title, rows) tables) and, when asked, write the whole result as
    JSON ('-' for stdout, instead of the tables)."""
    if json_path == "-":
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
        return
    print(f"\n{title}")
    print(table(rows, columns))
    for sub_title, sub_rows in more:
        print(f"\n{sub_title}")
        print(table(sub_rows))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"json: {json_path}")


def parallel(fn: Callable, items: Iterable, concurrency: int, desc: str) -> list:
    """fn over items on `concurrency` threads, results in input order, with a progress bar on stderr."""
    items = list(items)
    with ThreadPoolExecutor(max(1, concurrency)) as pool, \
            tqdm(total=len(items), desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True) as bar:
        futures = [pool.submit(fn, it) for it in items]
        for f in futures:
            f.add_done_callback(lambda _: bar.update())
        return [f.result() for f in futures]
