"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples: the share of each stall
reason over all samples, and the instructions that collect the most, per kernel of the report. Input: the CSV of
`ncu -i REPORT --page source --csv --print-source sass` (the report taken with `--set full`, or with the
SourceCounters section).

    ncu --set full -k regex:grouped_mma -o full python ...   # on the GPU
    ncu -i full.ncu-rep --page source --csv --print-source sass > source.csv
    python benchmarks/ncu_stalls.py source.csv [--top 12]
"""
import argparse
import collections
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: Path) -> list[tuple[str, list[dict]]]:
    """(name, instructions) per kernel of the CSV; each instruction a dict of its columns."""
    out, header = [], None
    for row in csv.reader(path.open()):
        if row[:1] == ["Kernel Name"]:
            out.append((row[1], []))
        elif row[:1] == ["Address"]:
            header = row
        elif row and row[0].startswith("0x"):
            if not out or header is None:
                raise ValueError(f"{path}: an instruction row before any 'Kernel Name' and 'Address' rows")
            out[-1][1].append(dict(zip(header, row)))
    if not out:
        raise ValueError(f"{path}: no kernel found; expected the CSV of ncu --page source --csv --print-source sass")
    return out


def stalls(instructions: list[dict]) -> tuple[int, collections.Counter]:
    """All samples and the samples of each stall reason (issued or not), summed over the instructions."""
    reasons = collections.Counter()
    for ins in instructions:
        for column, value in ins.items():
            if column.startswith("stall_") and "(Not Issued)" not in column:
                reasons[column[len("stall_"):]] += int(value or 0)
    return sum(int(ins[SAMPLES] or 0) for ins in instructions), reasons


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("--top", type=int, default=12, help="instructions to list per kernel")
    args = p.parse_args()
    for i, (name, instructions) in enumerate(kernels(args.csv)):
        total, reasons = stalls(instructions)
        print(f"kernel {i} {name}: {len(instructions)} instructions, {total} samples")
        for reason, n in reasons.most_common():
            if n:
                print(f"  {reason:<20} {n:>8} {100 * n / max(total, 1):5.1f}%")
        print("  top instructions (index in the kernel's SASS: samples, reasons over 15% of them)")
        for k, ins in sorted(enumerate(instructions), key=lambda e: -int(e[1][SAMPLES] or 0))[:args.top]:
            n = int(ins[SAMPLES] or 0)
            _, own = stalls([ins])
            main_reasons = ", ".join(f"{r} {v}" for r, v in own.most_common() if v > 0.15 * n)
            print(f"  [{k:4}] {n:6}  {ins['Source'].strip()[:56]:<56} {main_reasons}")


if __name__ == "__main__":
    main()
