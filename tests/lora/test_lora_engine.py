"""Multi-LoRA end to end on tiny random Llama and Qwen3 checkpoints with PEFT adapters built by
``peft`` (different ranks and targets, rsLoRA on one, random non-zero B): one ``generate`` call
mixing the adapters and the base with max_loras smaller than the number of adapters gives each
prompt HF + PEFT (merged) greedy tokens, with no compile after warm-up; prefix caching and
preemption keep each request on its adapter; tp=2 equals tp=1; bad adapters are refused with
the adapter's name and the reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from jaxserve.testing.lora_adapters import make_peft_adapter, merged_hf_model  # noqa: E402
from jaxserve.testing.tiny_model import make_tiny_model  # noqa: E402

NEW = 8
ADAPTERS = {  # name -> (rank, targets, rslora)
    "attn-qv": (8, ["q_proj", "v_proj"], False),
    "all-r4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
               False),
    "mlp-r16": (16, ["o_proj", "gate_proj", "down_proj"], True),
}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _targets(arch, targets):
    """Phi-3's checkpoint names: fused qkv_proj and gate_up_proj."""
    if arch != "phi3":
        return targets
    return sorted({FUSED.get(t, t) for t in targets})


@pytest.fixture(scope="module")
def family(tmp_path_factory, request):
    arch = request.param
    d = tmp_path_factory.mktemp(f"lora-{arch}")
    base = make_tiny_model(arch, d / "base")
    adapters = {}
    for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items()):
        adapters[name] = make_peft_adapter(base, d / name, r=r,
                                           target_modules=_targets(arch, targets),
                                           use_rslora=rs, seed=10 + i)
    return arch, base, adapters


_HF = {}


def hf_greedy(base, adapter, prompt, n=NEW):
    key = (str(base), str(adapter))
    if key not in _HF:
        _HF[key] = merged_hf_model(base, adapter)
    out = _HF[key].generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts(n, length=11):
    return [[(7 * i + 3 * j) % 400 + 20 for j in range(length + i)] for i in range(n)]


def _requests(adapters):
    from jaxserve import LoRARequest

    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in
            enumerate(adapters.items())]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                    pytest.param("phi3", marks=pytest.mark.slow)],
                         indirect=True)
def test_mixed_adapters_match_hf_peft(family):
    from jaxserve import LLM, SamplingParams

    arch, base, adapters = family
    loras = _requests(adapters)
    # every adapter twice and the base twice, interleaved: 3 adapters over 2 device slots
    per_prompt = [loras[0], None, loras[1], loras[2], loras[0], None, loras[2], loras[1]]
    prompts = _prompts(len(per_prompt))
    llm = LLM(str(base), **ENGINE)
    engine = llm.llm_engine
    steps = []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        steps.append({s.request.lora_int_id for s in out.scheduled} - {0})
        return out

    engine.scheduler.schedule = spy
    compiles = engine.runner.num_compiles
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=per_prompt, use_tqdm=False)
    assert engine.runner.num_compiles == compiles  # one graph for every mix
    assert max(len(s) for s in steps) == 2  # never more than max_loras adapters in a step
    assert engine.lora_manager.num_slot_loads >= 3  # the LRU evicted a slot
    for p, lora, out in zip(prompts, per_prompt, outs):
        want = hf_greedy(base, None if lora is None else adapters[lora.lora_name], p)
        assert out.outputs[0].token_ids == want, (arch, lora and lora.lora_name)
    # the adapters change the output (non-zero B): no two of them agree with the base
    firsts = {tuple(o.outputs[0].token_ids) for o in outs[:4]}
    assert len(firsts) == 4


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_prefix_cache_and_preemption_keep_the_adapter(family):
    from jaxserve import LLM, SamplingParams

    _, base, adapters = family
    loras = _requests(adapters)
    # a pool this small preempts while 8 requests decode (recompute, then their adapter again)
    llm = LLM(str(base), num_gpu_blocks_override=14, block_size=4, **ENGINE)
    prompt = _prompts(1, length=17)[0]
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], sp, lora_request=loras[1], use_tqdm=False)[0]
    again = llm.generate([prompt, prompt], sp, lora_request=[loras[1], loras[0]],
                         use_tqdm=False)
    assert again[0].num_cached_tokens == 16  # the same adapter reuses its pages
    assert again[1].num_cached_tokens == 0  # another adapter never does
    assert first.outputs[0].token_ids == again[0].outputs[0].token_ids \
        == hf_greedy(base, adapters["all-r4"], prompt)
    assert again[1].outputs[0].token_ids == hf_greedy(base, adapters["attn-qv"], prompt)

    per_prompt = [loras[i % 3] if i % 4 else None for i in range(8)]
    prompts = _prompts(8, length=9)
    before = llm.llm_engine.scheduler.num_preemptions_total
    outs = llm.generate(prompts, sp, lora_request=per_prompt, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > before
    for p, lora, out in zip(prompts, per_prompt, outs):
        want = hf_greedy(base, None if lora is None else adapters[lora.lora_name], p)
        assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("family", ["qwen3"], indirect=True)
def test_bad_adapters_name_the_adapter_and_reason(family, tmp_path):
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.errors import InvalidRequestError

    _, base, adapters = family
    # refused before any step: no warm-up needed
    llm = LLM(str(base), enforce_eager=True, **{**ENGINE, "max_lora_rank": 8})
    sp = SamplingParams(max_tokens=2)

    def refused(lora, match):
        with pytest.raises(InvalidRequestError, match=match) as e:
            llm.generate([[5, 6, 7]], sp, lora_request=lora, use_tqdm=False)
        assert e.value.status_code == 400
        assert not llm.llm_engine.has_unfinished_requests()

    refused(LoRARequest("big", 1, str(adapters["mlp-r16"])),
            r"LoRA adapter 'big': rank 16 exceeds max_lora_rank 8")
    other = make_tiny_model("llama", tmp_path / "llama")  # head_dim 16, not Qwen3's 32
    wrong = make_peft_adapter(other, tmp_path / "wrong", r=4, target_modules=["q_proj"])
    refused(LoRARequest("wrong-base", 2, str(wrong)), r"'wrong-base': .*shape mismatch")
    cfg = json.loads((Path(adapters["attn-qv"]) / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "c_attn"]
    bad = tmp_path / "bad-target"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    (bad / "adapter_model.safetensors").write_bytes(
        (Path(adapters["attn-qv"]) / "adapter_model.safetensors").read_bytes())
    refused(LoRARequest("odd", 3, str(bad)), r"'odd': target module 'c_attn' is not")
    refused(LoRARequest("missing", 4, str(tmp_path / "nope")), r"'missing': .*not a directory")
    plain = LLM(str(base), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                enforce_eager=True)
    with pytest.raises(InvalidRequestError, match="'attn-qv': LoRA is not enabled"):
        plain.generate([[5, 6]], sp, lora_request=_requests(adapters)[0], use_tqdm=False)


TP_CHILD = """
import json, sys
from jaxserve import LLM, LoRARequest, SamplingParams
base, adapters, prompts = json.loads(sys.argv[1])
loras = [None] + [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
per = [loras[i % len(loras)] for i in range(len(prompts))]
out = {}
for tp in (1, 2):
    llm = LLM(base, tensor_parallel_size=tp, max_num_seqs=8, max_num_batched_tokens=32,
              max_model_len=128, enable_lora=True, max_loras=3, max_lora_rank=16)
    res = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                       lora_request=per, use_tqdm=False)
    out[tp] = [r.outputs[0].token_ids for r in res]
print(json.dumps(out))
""".replace("NEW", str(NEW))


@pytest.mark.slow  # a child process with two CPU devices compiling tp=1 and tp=2
@pytest.mark.parametrize("family", ["qwen3"], indirect=True)
def test_tp2_equals_tp1(family):
    _, base, adapters = family
    prompts = _prompts(4)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    arg = json.dumps([str(base), {k: str(v) for k, v in adapters.items()}, prompts])
    proc = subprocess.run([sys.executable, "-c", TP_CHILD, arg], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["1"] == out["2"]
    names = [None] + list(adapters)
    for i, p in enumerate(prompts):
        name = names[i % len(names)]
        assert out["2"][i] == hf_greedy(base, None if name is None else adapters[name], p)
