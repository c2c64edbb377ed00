"""Print the registers / spills / shared memory tables of the attention kernels and the GGUF weight matmuls
compiled for sm_90 (markdown).

    python scripts/kernel_resources.py                  # the default configuration of every shape class
    python scripts/kernel_resources.py --all-candidates # every configuration `bench kernels --tune` may pick
    python scripts/kernel_resources.py --gguf           # the GGUF weight matmuls' table only

No GPU needed; exits 0 with one line when this Triton build cannot compile for sm_90.
"""

import argparse
import sys

from pagedchat.bench.kernel_resources import (GGUF_HEADER, HEADER, Unavailable, gguf_cases, gguf_markdown_row,
                                              gguf_resource_rows, markdown_row, resource_rows, table_cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-candidates", action="store_true", help="also every tuning candidate")
    parser.add_argument("--gguf", action="store_true", help="only the GGUF weight matmuls")
    args = parser.parse_args()
    tables = [(GGUF_HEADER, gguf_resource_rows(gguf_cases()), gguf_markdown_row)]
    if not args.gguf:
        tables.insert(0, (HEADER, resource_rows(table_cases(), all_candidates=args.all_candidates), markdown_row))
    spilling = 0
    try:
        for t, (header, rows, to_markdown) in enumerate(tables):
            for i, row in enumerate(rows):
                if i == 0:
                    print(("\n" if t else "") + "\n".join(header))   # a blank line between tables
                print(to_markdown(row), flush=True)
                spilling += bool(row["resources"].spill_stores or row["resources"].spill_loads)
    except Unavailable as exc:
        print(f"skipped: {exc}")
        return 0
    if spilling:
        print(f"\n{spilling} configuration(s) spill registers", file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
