"""Print the registers / spills / shared memory table of the attention kernels compiled for sm_90 (markdown).

    python scripts/kernel_resources.py                  # the default configuration of every shape class
    python scripts/kernel_resources.py --all-candidates # every configuration `bench kernels --tune` may pick

No GPU needed; exits 0 with one line when this Triton build cannot compile for sm_90.
"""

import argparse
import sys

from pagedchat.bench.kernel_resources import HEADER, Unavailable, markdown_row, resource_rows, table_cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-candidates", action="store_true", help="also every tuning candidate")
    args = parser.parse_args()
    spilling = 0
    try:
        for i, row in enumerate(resource_rows(table_cases(), all_candidates=args.all_candidates)):
            if i == 0:
                print("\n".join(HEADER))
            print(markdown_row(row), flush=True)
            spilling += bool(row["resources"].spill_stores or row["resources"].spill_loads)
    except Unavailable as exc:
        print(f"skipped: {exc}")
        return 0
    if spilling:
        print(f"\n{spilling} configuration(s) spill registers", file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
