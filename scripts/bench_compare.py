"""Before/after table of two benchmark runs (`python -m rustc10d.bench --json ...`): for each op,
world size and size, the ratio Gloo time / rustc10d time (median over the run's rounds, each
round's ratio taken within that round) per rustc10d series, before -> after.

    python scripts/bench_compare.py before.json after.json [--sizes 8,2K,2M,8M,32M,64M]
"""

from __future__ import annotations

import argparse
import json
import statistics


def size_of(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def ratios(result: dict) -> dict[str, float]:
    """series -> median over rounds of gloo time / series time."""
    backends = result["backends"]
    gloo = backends.get("gloo", {})
    out = {}
    for name, b in backends.items():
        if name == "gloo" or b.get("status") != "ok" or gloo.get("status") != "ok":
            continue
        pairs = zip(gloo["times_s"], b["times_s"])
        out[name.removeprefix("rustc10d-")] = statistics.median(g / t for g, t in pairs)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--sizes", default="8,2K,2M,8M,32M,64M")
    a = p.parse_args()
    sizes = [size_of(s) for s in a.sizes.split(",")]
    runs = [json.load(open(f)) for f in (a.before, a.after)]
    keyed = [{(r["world"], r["op"], r["dtype"], r["size"]): r for r in run["results"]} for run in runs]
    rows = sorted({k[:3] for k in keyed[0]} & {k[:3] for k in keyed[1]})
    series = sorted({s for k in keyed[1].values() for s in ratios(k)})
    print(f"ratio = Gloo time / rustc10d time, median of rounds; before -> after; series: {', '.join(series)}")
    print("| op | W | " + " | ".join(label(s) for s in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for world, op, dtype in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
        cells = []
        for size in sizes:
            before, after = (k.get((world, op, dtype, size)) for k in keyed)
            if not before or not after:
                cells.append("")
                continue
            rb, ra = ratios(before), ratios(after)
            cells.append(" / ".join(f"{rb.get(s, float('nan')):.2f}→{ra.get(s, float('nan')):.2f}" for s in series))
        print(f"| {op} {dtype} | {world} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
