"""Where the test suite's time goes: the CPU-seconds of each test file, heaviest first.

    python tools/test_times.py            # per file, from the last run's runs/test-cpu.json
    python tools/test_times.py --tests    # per test, the heaviest 40
    python tools/test_times.py --write    # also write tests/heavy_files.txt (the order the
                                          # xdist workers are handed the files, tests/conftest.py)

Every pytest run writes ``runs/test-cpu.json`` (tests/conftest.py): each test's user + system
CPU-seconds, its worker's and its waited-for children's (ranks, kernels, torchrun launches). A
module-scoped server (the browser tests' JupyterLab and chromium) is reaped after the module's last
test, and is counted there.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "runs" / "test-cpu.json"
HEAVY = ROOT / "tests" / "heavy_files.txt"


def per_file(cpu: dict[str, float]) -> list[tuple[str, float, int]]:
    """(file, CPU-seconds, tests) for every file of the report, heaviest first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for nodeid, seconds in cpu.items():
        name = nodeid.split("::", 1)[0]
        total[name] += seconds
        count[name] += 1
    return sorted(((f, total[f], count[f]) for f in total), key=lambda t: (-t[1], t[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=REPORT)
    parser.add_argument("--tests", action="store_true", help="per test, not per file")
    parser.add_argument("--write", action="store_true", help=f"write {HEAVY.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if not args.report.exists():
        parser.error(f"{args.report} is missing: run the tests first (python -m pytest)")
    cpu = json.loads(args.report.read_text())
    files = per_file(cpu)
    print(f"{sum(cpu.values()):.0f} CPU-s in {len(cpu)} tests, {len(files)} files")
    if args.tests:
        for nodeid, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:40]:
            print(f"{seconds:8.1f}  {nodeid}")
    else:
        for name, seconds, n in files:
            print(f"{seconds:8.1f}  {n:4d} tests  {name}")
    if args.write:
        lines = [f"{seconds:8.1f}  {name}" for name, seconds, _ in files if seconds >= 5]
        HEAVY.write_text(
            "# Test files heaviest first (CPU-seconds of one fast-tier run on 2 cores), the order\n"
            "# the xdist workers are handed them (tests/conftest.py). python tools/test_times.py\n"
            "# --write makes it from the last run; a file not listed goes after these.\n"
            + "\n".join(lines)
            + "\n"
        )
        print(f"wrote {HEAVY.relative_to(ROOT)} ({len(lines)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
