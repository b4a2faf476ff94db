"""Combine the JUnit reports of every launch and rank into one closing line.

A test of a torchrun launch counts once: failed if it failed on any rank, else passed (or
skipped). Prints a table per launch and last ``Total: N passed, N failed, N skipped``.
"""

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def outcomes(path: Path) -> dict:
    """Test id -> 'passed' | 'failed' | 'skipped' for one JUnit file."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            result[name] = "failed"
        elif "skipped" in kinds:
            result[name] = "skipped"
        else:
            result[name] = "passed"
    return result


def main(folder: str) -> int:
    launches = defaultdict(dict)
    for path in sorted(Path(folder).glob("world*.xml")):
        launch = path.stem.split("-")[0]
        for name, outcome in outcomes(path).items():
            previous = launches[launch].get(name)
            if previous != "failed":
                launches[launch][name] = outcome
    totals = defaultdict(int)
    for launch, tests in sorted(launches.items(), key=lambda kv: int(kv[0][5:])):
        counts = defaultdict(int)
        for outcome in tests.values():
            counts[outcome] += 1
            totals[outcome] += 1
        print(
            f"{launch:8s} {counts['passed']:5d} passed {counts['failed']:3d} failed "
            f"{counts['skipped']:3d} skipped"
        )
        for name, outcome in tests.items():
            if outcome == "failed":
                print(f"  FAILED {name}")
    if not launches:
        print("no test reports found")
        return 1
    print(
        f"Total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "test-reports"))
