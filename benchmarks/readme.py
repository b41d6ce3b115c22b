"""Copy the benchmark tables into README.md, so its figures are never typed.

    .venv/bin/python -m benchmarks.readme

Between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` the README gets
`benchmarks/results/NAME.md` as the last run wrote it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ._server import RESULTS

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(.*?)(<!-- /bench:(?P=name) -->)", re.S)


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    text = README.read_text()

    def fill(match: re.Match[str]) -> str:
        table = (RESULTS / f"{match['name']}.md").read_text().strip()
        return f"{match.group(1)}{table}\n{match.group(4)}"

    new, count = BLOCK.subn(fill, text)
    README.write_text(new)
    print(f"README.md: {count} benchmark tables updated")


if __name__ == "__main__":
    main()
