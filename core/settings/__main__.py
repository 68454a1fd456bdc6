"""`python -m tfdist.settings --reference`: print docs/configuration.md (see `reference`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfdist.settings", description=__doc__)
    p.add_argument("--reference", action="store_true", help="print the configuration reference (Markdown)")
    p.add_argument("--output", default="-", help="write it here instead of stdout")
    opts = p.parse_args(argv)
    if not opts.reference:
        p.print_help()
        return 2
    from .reference import render

    text = render()
    if opts.output == "-":
        sys.stdout.write(text)
    else:
        with open(opts.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
