"""Images in: images per second and time to first token for prompts of 1 image + 64 text
tokens -> 32 output tokens, jaxserve (``LLM.generate`` with ``multi_modal_data``) against HF
``generate`` on the same checkpoint in the same run.

    python benchmarks/multimodal.py                    # CPU: the tiny random Qwen 3.5 VLM
    python benchmarks/multimodal.py --shape 27b        # GPU: Qwen3.6-27B-shaped dummy VLM
                                                       # (tools/gpu_run.sh "multimodal")
    python benchmarks/multimodal.py --shape dummy-cpu  # the GPU stage's path, small, on CPU

``images/s``: ``--num-requests`` requests, each with its own picture (every one runs the
encoder), submitted together; requests finished per second. ``TTFT``: one request at a time,
median over ``--ttft-requests`` (arrival to first token). HF runs the same prompts one by one
(its ``generate`` has no continuous batching): TTFT is a ``max_new_tokens=1`` call. The 27b
shape has random weights (no HF baseline: its reference is the tiny run's ratio) and caps the
image processor at ``--max-pixels`` (the encoder's largest patch bucket follows from it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common as C  # noqa: E402

DEFAULT_DIR = os.path.join(C.RESULTS_DIR, "multimodal")
IMAGE_TOKEN = 248056
VISION_27B = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh",
                  intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=5120,
                  num_position_embeddings=2304, model_type="qwen3_5_vision",
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"})
VISION_CPU = dict(VISION_27B, depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=256, num_position_embeddings=64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=["tiny", "27b", "dummy-cpu"], default=None,
                   help="default: 27b on an accelerator, tiny otherwise")
    p.add_argument("--num-layers", type=int, default=None, help="27b: cut the text depth")
    p.add_argument("--image-size", type=int, default=None,
                   help="square image side in pixels (default: 128 tiny, 448 27b)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--ttft-requests", type=int, default=5)
    p.add_argument("--max-pixels", type=int, default=802816,
                   help="27b: the image processor's longest_edge (pixels)")
    p.add_argument("--quantization", default=None)
    p.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    p.add_argument("--seed", type=int, default=0)
    C.add_output_args(p)
    args = p.parse_args(argv)
    args.shape = args.shape or ("27b" if C.on_accelerator() else "tiny")
    args.image_size = args.image_size or (448 if args.shape == "27b" else 128)
    if args.shape == "dummy-cpu":
        args.max_pixels = min(args.max_pixels, 128 * 128)
    args.result_dir = args.result_dir or DEFAULT_DIR
    return args


def write_dummy(shape: str, num_layers: int | None, max_pixels: int) -> str:
    """A Qwen3.6-27B-shaped VLM directory (config, tokenizer, image processor; no weights);
    ``shape`` "cpu": hybrid_decode's scaled-down text stack and a small tower."""
    from benchmarks.hybrid_decode import configs
    from jaxserve.testing.presets import write_preset

    text = configs(argparse.Namespace(shape=shape, num_layers=num_layers))["hybrid"]
    image_token = IMAGE_TOKEN if shape == "27b" else text["vocab_size"] - 4
    text.pop("architectures", None)
    cfg = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
               text_config=dict(text, model_type="qwen3_5_text"),
               vision_config=VISION_27B if shape == "27b" else VISION_CPU,
               image_token_id=image_token, video_token_id=image_token + 1,
               vision_start_token_id=image_token - 3, vision_end_token_id=image_token - 2,
               vocab_size=text["vocab_size"], bos_token_id=text["bos_token_id"],
               eos_token_id=text["eos_token_id"], tie_word_embeddings=False)
    out = write_preset("qwen3.6", os.path.join(tempfile.mkdtemp(prefix="mm-bench-"),
                                               f"qwen3.6-{shape}-vl"), config=cfg)
    pre = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
           "temporal_patch_size": 2, "merge_size": 2,
           "size": {"shortest_edge": min(65536, max_pixels // 4), "longest_edge": max_pixels},
           "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f)
    return out


def prompts(args, image_id: int, vocab: int):
    """(token ids with one image placeholder, image) per request: distinct pictures."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_requests + args.ttft_requests):
        text = rng.integers(10, min(vocab, 500), args.text_tokens).tolist()
        ids = text[:4] + [image_id] + text[4:]
        px = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
        out.append((ids, Image.fromarray(px)))
    return out


def run_jaxserve(model_dir: str, items, args, image_id: int) -> dict:
    from jaxserve import LLM, SamplingParams

    accel = C.on_accelerator()
    kw = dict(max_model_len=2048 if accel else 512, max_num_seqs=args.num_requests, seed=0,
              max_num_batched_tokens=2048 if accel else 256, enable_prefix_caching=False,
              quantization=args.quantization)
    if args.shape != "tiny":
        kw.update(load_format="dummy", token_bucket_growth=128 if accel else None,
                  enforce_eager=not accel)
    else:
        kw.update(dtype="float32", min_token_bucket=64)
    t0 = time.perf_counter()
    llm = LLM(model_dir, **{k: v for k, v in kw.items() if v is not None})
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    warm = runner.num_compiles
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def req(ids, im):
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": im}}

    llm.generate([req(*items[0])], sp, use_tqdm=False)  # an untimed round
    batch = items[:args.num_requests]
    t = time.perf_counter()
    llm.generate([req(*x) for x in batch], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    ttfts = []
    for x in items[args.num_requests:]:
        (o,) = llm.generate([req(*x)], sp, use_tqdm=False)
        ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
    return dict(start_s=start_s, images_per_s=len(batch) / wall, batch_wall_s=wall,
                ttft_s=statistics.median(ttfts), ttft_all_s=ttfts,
                image_tokens=runner.mm.entries[next(iter(runner.mm.entries))][1],
                encoder_buckets=runner.mm.ladder, images_encoded=runner.mm.num_encoded,
                compiles_after_warmup=runner.num_compiles - warm)


def run_hf(model_dir: str, items, args) -> dict:
    import numpy as np
    import torch
    import transformers as tf

    from jaxserve.multimodal.processor import ImageProcessor, expand_placeholders

    torch.manual_seed(0)
    model = tf.Qwen3_5ForConditionalGeneration.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    proc = ImageProcessor(model_dir)
    image_id = model.config.image_token_id

    def gen(ids, im, n):
        p = proc.process([im])
        full = expand_placeholders(ids, image_id, p)
        with torch.no_grad():
            model.generate(torch.tensor([full]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0,
                           pixel_values=torch.from_numpy(p[0].pixel_values),
                           image_grid_thw=torch.tensor([p[0].grid_thw]),
                           mm_token_type_ids=torch.tensor([[int(t == image_id)
                                                            for t in full]]))

    gen(*items[0], 2)
    t = time.perf_counter()
    for x in items[:args.num_requests]:
        gen(*x, args.output_len)
    wall = time.perf_counter() - t
    ttfts = []
    for x in items[args.num_requests:]:
        t1 = time.perf_counter()
        gen(*x, 1)
        ttfts.append(time.perf_counter() - t1)
    return dict(images_per_s=args.num_requests / wall, batch_wall_s=wall,
                ttft_s=float(np.median(ttfts)), ttft_all_s=ttfts)


def main(argv=None):
    args = parse_args(argv)
    if args.shape == "tiny":
        from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

        model_dir = str(make_tiny_qwen3_5(os.path.join(tempfile.mkdtemp(prefix="mm-bench-"),
                                                       "tiny-vl"), vl=True, mtp=False))
    else:
        model_dir = write_dummy("27b" if args.shape == "27b" else "cpu", args.num_layers,
                                args.max_pixels)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    image_id = cfg["image_token_id"]
    items = prompts(args, image_id, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    ours = run_jaxserve(model_dir, items, args, image_id)
    print(f"jaxserve: {ours['images_per_s']:.2f} images/s, TTFT {ours['ttft_s'] * 1e3:.0f} ms",
          flush=True)
    hf = None
    if args.shape == "tiny" and not args.no_hf:
        hf = run_hf(model_dir, items, args)
        print(f"HF generate: {hf['images_per_s']:.2f} images/s, TTFT "
              f"{hf['ttft_s'] * 1e3:.0f} ms", flush=True)
    result = dict(benchmark="multimodal", **C.run_metadata(),
                  config=dict(shape=args.shape, image_size=args.image_size,
                              text_tokens=args.text_tokens, output_len=args.output_len,
                              num_requests=args.num_requests, max_pixels=args.max_pixels,
                              quantization=args.quantization, num_layers=args.num_layers),
                  jaxserve=ours, hf_generate=hf,
                  ratios=None if hf is None else dict(
                      images_per_s=ours["images_per_s"] / hf["images_per_s"],
                      ttft=ours["ttft_s"] / hf["ttft_s"]))
    path = C.write_json(C.result_path(f"multimodal-{args.shape}", args), result)
    print("wrote", path)
    if not args.no_plot:
        names = ["jaxserve"] + (["HF generate"] if hf else [])
        runs = [ours] + ([hf] if hf else [])
        C.bar_plot(path[:-5] + ".png", ["images/s", "TTFT (ms)"],
                   {n: [r["images_per_s"], r["ttft_s"] * 1e3] for n, r in zip(names, runs)},
                   ylabel="value", title=f"1 image ({args.image_size}px) + {args.text_tokens} "
                   f"tokens -> {args.output_len}, {args.shape} ({result['device']})")
    return result


if __name__ == "__main__":
    main()
