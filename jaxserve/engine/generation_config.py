"""A model's own generation defaults (``generation_config.json``), as vLLM applies them.

``--generation-config auto`` (the default) reads the file next to the model; ``vllm`` ignores
it (SamplingParams' own defaults); a directory reads that directory's file.
``--override-generation-config`` (a JSON object) is laid over whichever was read. The model's
sampling fields become request defaults: a request that leaves ``temperature`` (and the other
fields in ``SAMPLING_FIELDS``) unset gets the model's value. Its ``eos_token_id`` joins the EOS
ids of config.json and the tokenizer: generation stops at any of them.
"""
from __future__ import annotations

import json
from pathlib import Path

# generation_config.json field -> SamplingParams field (vLLM's set)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


def load_generation_config(source: str, model_dir: str | Path | None,
                           overrides: dict | None = None) -> dict:
    """The generation config to serve with: ``source`` is ``auto``, ``vllm`` or a directory."""
    if source not in ("auto", "vllm"):
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config: no generation_config.json in {source!r}")
        config = _read(path)
    elif source == "auto" and model_dir is not None and Path(model_dir).is_dir():
        path = Path(model_dir) / "generation_config.json"
        config = _read(path) if path.is_file() else {}
    else:
        config = {}
    config.update(overrides or {})
    return config


def _read(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"generation_config: {path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return config


def default_sampling(generation_config: dict) -> dict:
    """The SamplingParams defaults a request gets for the fields it leaves unset.

    Only a config that samples (``do_sample`` true or absent) contributes its sampling fields;
    a greedy ``do_sample: false`` config is not turned into temperature 0.
    """
    if generation_config.get("do_sample") is False:
        return {}
    return {ours: generation_config[theirs] for theirs, ours in SAMPLING_FIELDS.items()
            if generation_config.get(theirs) is not None}


def eos_token_ids(*sources) -> tuple[int, ...]:
    """The union of EOS ids from each source (an int, a list of ints or None), first seen
    first: config.json, generation_config.json, the tokenizer."""
    ids: dict[int, None] = {}
    for eos in sources:
        if eos is None:
            continue
        for t in (eos if isinstance(eos, (list, tuple)) else [eos]):
            ids[int(t)] = None
    return tuple(ids)
