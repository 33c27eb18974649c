"""What every probe ends with: a plain-text summary table, JSON for machines, and a progress bar while it runs."""
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
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
    """Rows of dicts as an aligned text table; columns default to every key of the rows, in order of appearance."""
    if not rows:
        return "(no rows)"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


class Reasons:
    """Why requests failed: messages grouped by their wording (numbers aside), numbered in order of first
    appearance. Table cells name them ("2 [1]"); the messages follow the table, one line each."""

    def __init__(self):
        self.groups: dict[str, list] = {}       # wording -> [number, first message, requests]

    def refs(self, errors) -> str:
        """'[1]', '[1][3]': the groups of the failures among `errors` (None entries are successes)."""
        numbers = []
        for e in filter(None, errors):
            group = self.groups.setdefault(re.sub(r"\d+", "#", e), [len(self.groups) + 1, e, 0])
            group[2] += 1
            numbers += [group[0]] if group[0] not in numbers else []
        return "".join(f"[{n}]" for n in numbers)

    def cell(self, errors) -> str | int:
        """The failure count and its reasons for a table cell: 0, or e.g. '3 [1]'."""
        errors = list(errors)
        n = sum(map(bool, errors))
        return f"{n} {self.refs(errors)}" if n else 0

    def lines(self) -> list[str]:
        return [f"[{n}] {count} request{'s' * (count > 1)}: {message}" for n, message, count in self.groups.values()]


def emit(title: str, rows: list[dict], result: dict, json_path: str | None, columns: list[str] | None = None,
         more: tuple[tuple[str, list[dict]], ...] = (), notes: Iterable[str] = ()):
    """Print the summary table (and any `more` (title, rows) tables), then the `notes` (e.g. Reasons.lines()),
    and, when asked, write the whole result as JSON ('-' for stdout, instead of the tables)."""
    if json_path == "-":
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
        return
    print(f"\n{title}")
    print(table(rows, columns))
    for sub_title, sub_rows in more:
        print(f"\n{sub_title}")
        print(table(sub_rows))
    notes = list(notes)
    if notes:
        print("\n" + "\n".join(notes))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"json: {json_path}")


class Stop:
    """When `parallel` stops starting items: at a deadline (a time.monotonic() value; an item is not started
    when the median item so far would end after it), or on Ctrl-C. Items already running finish either way."""

    def __init__(self, deadline: float | None = None):
        self.deadline = deadline
        self.reason: str | None = None          # why items were left out, once some were
        self.durations: list[float] = []

    def due(self) -> bool:
        if self.reason is None and self.deadline is not None and self.durations:
            if time.monotonic() + statistics.median(self.durations) > self.deadline:
                self.reason = "time limit"
        return self.reason is not None


def shortfall(stopped: str | None, done: int, asked: int, what: str, time_limit: float) -> list[str]:
    """The note that says a run scored fewer items than asked, and why ([] when it scored them all)."""
    if not stopped:
        return []
    why = (f"the {time_limit:g} s time limit was reached (--time-limit 0 runs them all)" if stopped == "time limit"
           else "interrupted")
    return [f"{done} of {asked} {what} scored: {why}"]


def parallel(fn: Callable, items: Iterable, concurrency: int, desc: str, stop: Stop | None = None) -> list:
    """fn over items on `concurrency` threads, results in input order, with a progress bar on stderr. Items
    not started because of `stop` (or of a first Ctrl-C, which lets running items finish) give None."""
    items, stop = list(items), stop or Stop()

    def one(item):
        if stop.due():
            return None
        t0 = time.monotonic()
        out = fn(item)
        stop.durations.append(time.monotonic() - t0)
        return out

    with ThreadPoolExecutor(max(1, concurrency)) as pool, \
            tqdm(total=len(items), desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True) as bar:
        futures = [pool.submit(one, it) for it in items]
        for f in futures:                   # items left out do not count as done
            f.add_done_callback(lambda f: bar.update(f.exception() is not None or f.result() is not None))
        try:
            wait(futures)
        except KeyboardInterrupt:
            stop.reason = "interrupted"
            print("\ninterrupted: the requests in flight finish, then the table", file=sys.stderr)
            wait(futures)
        return [f.result() for f in futures]
