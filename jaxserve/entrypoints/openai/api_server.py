"""vLLM's older entry point: ``python -m jaxserve.entrypoints.openai.api_server --model M``.

The same command line as ``jaxserve serve`` (one parser: :func:`jaxserve.entrypoints.cli.
add_serve_args`), so a deployment written for ``python -m vllm.entrypoints.openai.api_server``
changes one word.
"""
from __future__ import annotations

import sys

from jaxserve.entrypoints import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
