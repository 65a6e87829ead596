#!/usr/bin/env python
"""Build a random-weight tiny HF checkpoint (+ trained BPE tokenizer) of a Llama-family model.

    python tools/make_tiny_model.py --arch qwen3 --out /tmp/tiny-qwen3 --layers 2 --hidden 64
    python tools/make_tiny_model.py --preset tinyllama-1.1b --out /tmp/tinyllama   # no weights
    python tools/make_tiny_model.py --arch qwen3_5 --out /tmp/tiny-qwen36 --distill-mtp 60

``qwen3_5`` / ``qwen3_5_moe`` (Qwen 3.6) come with a random multi-token-prediction head
(``mtp.*``); ``--distill-mtp STEPS`` trains it on the model's own greedy text (dense only) so
that ``--speculative-config '{"method": "mtp", ...}'`` sees drafts accepted.

The logic lives in ``jaxserve.loaders.demo_model`` so tests and the ``demo-random`` model share it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.testing.presets import PRESETS, write_preset  # noqa: E402
from jaxserve.testing.tiny_model import ARCHS, ROPE_PRESETS, make_tiny_model  # noqa: E402

QWEN3_5 = {"qwen3_5": False, "qwen3_5_moe": True}  # arch -> mixture of experts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS) + list(QWEN3_5))
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a real model shape: config.json + tokenizer only, no weights "
                         "(serve or benchmark it with --load-format dummy)")
    ap.add_argument("--out", required=True, type=Path)
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "vocab", "intermediate",
                 "experts", "experts-per-tok",
                 "sliding-window", "max-position", "seed"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--tie-embeddings", action="store_true", default=None)
    ap.add_argument("--norm-topk-prob", action="store_true", default=None,
                    help="qwen3_moe/qwen2_moe: renormalise the top-k router weights")
    ap.add_argument("--rope-scaling", choices=sorted(ROPE_PRESETS))
    ap.add_argument("--max-shard-size", help='e.g. "20KB" to write several safetensors files')
    ap.add_argument("--no-torch", action="store_true", help="write numpy weights (no torch)")
    ap.add_argument("--vl", action="store_true", default=None,
                    help="qwen3_5*: the vision-language class layout")
    ap.add_argument("--distill-mtp", type=int, default=None, metavar="STEPS",
                    help="qwen3_5: train the MTP head for STEPS steps (default: random)")
    args = ap.parse_args(argv)
    if args.preset:
        if args.arch:
            ap.error("--preset and --arch exclude each other")
        print(write_preset(args.preset, str(args.out)))
        return 0
    if not args.arch:
        ap.error("one of --arch or --preset is required")
    if args.arch in QWEN3_5:
        from jaxserve.testing.qwen3_5 import TorchMtpHead, make_tiny_qwen3_5

        out = make_tiny_qwen3_5(args.out, moe=QWEN3_5[args.arch], vl=bool(args.vl),
                                seed=args.seed or 0)
        if args.distill_mtp:
            if QWEN3_5[args.arch]:
                ap.error("--distill-mtp: dense qwen3_5 only")
            head = TorchMtpHead(out)
            head.distill(steps=args.distill_mtp)
            head.save(out)
        print(out)
        return 0
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("arch", "out", "no_torch") and v is not None}
    out = make_tiny_model(args.arch, args.out, use_torch=False if args.no_torch else None,
                          **overrides)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
