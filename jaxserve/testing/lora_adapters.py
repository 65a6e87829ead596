"""PEFT LoRA adapters for tests and benchmarks: built with ``peft`` over an HF checkpoint (the
reference side merges them), or written directly from shapes (no torch) for served models such
as the GGUF default."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_peft_adapter(base_dir, out_dir, *, r: int, target_modules, lora_alpha: float = 16,
                      use_rslora: bool = False, seed: int = 0, std: float = 0.05) -> Path:
    """A PEFT adapter of the HF checkpoint ``base_dir`` with random A and **non-zero** random B
    (PEFT starts B at zero, which would make every adapter the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                     use_rslora=use_rslora, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn_like(p) * std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def merged_hf_model(base_dir, adapter_dir):
    """The HF reference of an adapter: base + adapter, merged (PEFT's ``merge_and_unload``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


def write_random_adapter(out_dir, shapes: dict[str, tuple[int, int]], *, r: int,
                         target_modules, lora_alpha: float = 32, seed: int = 0,
                         std: float = 0.02, base_model: str = "") -> Path:
    """A PEFT-format adapter written from the model's projection shapes (state path ->
    (in, out)) for every projection whose name is in ``target_modules``; random A and B."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for path, (d_in, d_out) in sorted(shapes.items()):
        if path.rsplit(".", 1)[1] not in target_modules:
            continue
        key = f"base_model.model.{path}"
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, d_in)) * std).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, r)) * std).astype(np.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
        use_rslora=False, bias="none", lora_dropout=0.0, base_model_name_or_path=base_model,
        task_type="CAUSAL_LM"), indent=2))
    return out
