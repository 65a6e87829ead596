"""EngineArgs: every engine flag declared once, and the parser, ``LLM(**kwargs)`` and the
EngineConfig all derived from it (introspection: a flag added by hand anywhere else, or a
config field no flag reaches, fails here)."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from jaxserve.args import GROUPS, EngineArgs, engine_config_from_kwargs, flags
from jaxserve.config import (CacheConfig, EngineConfig, LoRAConfig, MultiModalConfig,
                             ParallelConfig, SchedulerConfig, SpeculativeConfig)
from jaxserve.entrypoints.cli import build_parser, engine_config_from_args, engine_kwargs_from_args
from jaxserve.entrypoints.openai.cli_args import FrontendArgs

# One non-default value per targeted flag: the command line (or, for an LLM-only argument, the
# keyword arguments), the EngineConfig path it must reach and the value expected there.
SAMPLES = {
    "model": (["--model", "m"], "model", "m"),
    "runner": (["--runner", "pooling"], "runner", "pooling"),
    "task": (["--task", "reward"], "pooling_task", "encode"),
    "pooler_config": (["--pooler-config", '{"pooling_type": "MEAN"}'],
                      "pooler_config.pooling_type", "MEAN"),
    "tokenizer": (["--tokenizer", "tok"], "tokenizer", "tok"),
    "tokenizer_mode": (["--tokenizer-mode", "hf"], "tokenizer_mode", "hf"),
    "revision": (["--revision", "v1"], "revision", "v1"),
    "trust_remote_code": (["--trust-remote-code"], "trust_remote_code", True),
    "hf_overrides": (["--hf-overrides", '{"a": 1}'], "hf_overrides", {"a": 1}),
    "dtype": (["--dtype", "half"], "dtype", "float16"),
    "max_model_len": (["--max-model-len", "1k"], "scheduler.max_model_len", 1000),
    "quantization": (["-q", "int8"], "quantization", "int8"),
    "lm_head_quantized": (["-q", "fp8", "--lm-head-quantized"], "lm_head_quantized", True),
    "seed": (["--seed", "7"], "seed", 7),
    "served_model_name": (["--served-model-name", "a", "b"], "served_model_name", "a"),
    "enforce_eager": (["--enforce-eager"], "enforce_eager", True),
    "max_logprobs": (["--max-logprobs", "-1"], "max_logprobs", -1),
    "max_hidden_state_layers": (["--max-hidden-state-layers", "2"],
                                "max_hidden_state_layers", 2),
    "enable_prompt_embeds": (["--enable-prompt-embeds"], "enable_prompt_embeds", True),
    "logits_processors": (["--logits-processors", "a:B"], "logits_processors", ("a:B",)),
    "batch_invariant": (["--batch-invariant"], "batch_invariant", True),
    "generation_config": (["--generation-config", "vllm"], "generation_config", "vllm"),
    "override_generation_config": (["--override-generation-config", '{"temperature": 0.5}'],
                                   "override_generation_config", {"temperature": 0.5}),
    "allowed_local_media_path": (["--allowed-local-media-path", "/d"],
                                 "multimodal.allowed_local_media_path", "/d"),
    "allowed_media_domains": (["--allowed-media-domains", "A.example"],
                              "multimodal.allowed_media_domains", ("a.example",)),
    "load_format": (["--load-format", "dummy"], "load_format", "dummy"),
    "download_dir": (["--download-dir", "/dl"], "download_dir", "/dl"),
    "attention_backend": (["--attention-backend", "reference"], "attention_backend",
                          "reference"),
    "structured_outputs_compile_timeout": (["--structured-outputs-compile-timeout", "2.5"],
                                           "structured_outputs_compile_timeout", 2.5),
    "tensor_parallel_size": (["-tp", "2"], "parallel.tensor_parallel_size", 2),
    "pipeline_parallel_size": (["-pp", "2"], "parallel.pipeline_parallel_size", 2),
    "data_parallel_size": (["-dp", "2"], "parallel.data_parallel_size", 2),
    "enable_expert_parallel": (["-ep"], "parallel.enable_expert_parallel", True),
    "num_hosts": (["--nnodes", "2"], "parallel.num_hosts", 2),
    "host_index": (["--node-rank", "1"], "parallel.host_index", 1),
    "coordinator": (["--coordinator", "h:1"], "parallel.coordinator", "h:1"),
    "block_size": (["--block-size", "32"], "cache.block_size", 32),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"],
                               "cache.gpu_memory_utilization", 0.5),
    "num_gpu_blocks_override": (["--num-gpu-blocks-override", "9"],
                                "cache.num_gpu_blocks_override", 9),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], "cache.enable_prefix_caching",
                              False),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "cache.cache_dtype", "fp8"),
    "calculate_kv_scales": (["--kv-cache-dtype", "fp8", "--calculate-kv-scales"],
                            "cache.calculate_kv_scales", True),
    "swap_space": (["--swap-space", "1.5"], "cache.swap_space", 1.5),
    "kv_offloading_size": (["--kv-offloading-size", "2.5"], "cache.kv_offloading_size", 2.5),
    "kv_offloading_backend": (["--kv-offloading-size", "1", "--kv-offloading-backend", "native"],
                              "cache.kv_offloading_backend", "native"),
    "limit_mm_per_prompt": (["--limit-mm-per-prompt", '{"image": 2}'],
                            "multimodal.limit_mm_per_prompt", {"image": 2}),
    "mm_processor_kwargs": (["--mm-processor-kwargs", '{"max_pixels": 9}'],
                            "multimodal.mm_processor_kwargs", {"max_pixels": 9}),
    "disable_mm_preprocessor_cache": (["--disable-mm-preprocessor-cache"],
                                      "multimodal.disable_mm_preprocessor_cache", True),
    "enable_lora": (["--enable-lora"], "lora", LoRAConfig()),
    "max_loras": (["--enable-lora", "--max-loras", "3"], "lora.max_loras", 3),
    "max_lora_rank": (["--enable-lora", "--max-lora-rank", "8"], "lora.max_lora_rank", 8),
    "max_cpu_loras": (["--enable-lora", "--max-cpu-loras", "5"], "lora.max_cpu_loras", 5),
    "lora_allowed_paths": (["--enable-lora", "--lora-allowed-paths", "/a", "/b"],
                           "lora.allowed_paths", ("/a", "/b")),
    "kv_events_config": (["--kv-events-config", '{"enable_kv_cache_events": true}'],
                         "kv_events.enable_kv_cache_events", True),
    "kv_transfer_config": (["--kv-transfer-config",
                            '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'],
                           "kv_transfer.kv_role", "kv_consumer"),
    "max_num_seqs": (["--max-num-seqs", "3"], "scheduler.max_num_seqs", 3),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "77"],
                               "scheduler.max_num_batched_tokens", 77),
    "min_token_bucket": (["--min-token-bucket", "4"], "scheduler.min_token_bucket", 4),
    "token_bucket_growth": ({"token_bucket_growth": 3}, "scheduler.token_bucket_growth", 3),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"],
                               "scheduler.enable_chunked_prefill", False),
    "scheduling_policy": (["--scheduling-policy", "fcfs"], "scheduler.policy", "fcfs"),
    "preemption_mode": (["--preemption-mode", "swap"], "scheduler.preemption_mode", "swap"),
    "disable_hybrid_kv_cache_manager": (["--disable-hybrid-kv-cache-manager"],
                                        "scheduler.disable_hybrid_kv_cache_manager", True),
    "async_scheduling": (["--no-async-scheduling"], "async_scheduling", False),
    "speculative_config": (["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'],
                           "speculative.num_speculative_tokens", 2),
    "speculative_model": (["--speculative-model", "draft", "--num-speculative-tokens", "2"],
                          "speculative.model", "draft"),
    "num_speculative_tokens": (["--speculative-model", "[ngram]", "--num-speculative-tokens",
                                "3"], "speculative.num_speculative_tokens", 3),
    "speculative_draft_tensor_parallel_size": (
        ["--speculative-model", "d", "--num-speculative-tokens", "1",
         "--speculative-draft-tensor-parallel-size", "1"],
        "speculative.draft_tensor_parallel_size", 1),
    "ngram_prompt_lookup_max": (["--speculative-model", "[ngram]", "--num-speculative-tokens",
                                 "1", "--ngram-prompt-lookup-max", "3"],
                                "speculative.prompt_lookup_max", 3),
    "ngram_prompt_lookup_min": (["--speculative-model", "[ngram]", "--num-speculative-tokens",
                                 "1", "--ngram-prompt-lookup-min", "2"],
                                "speculative.prompt_lookup_min", 2),
}
PARTS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
         "multimodal": MultiModalConfig, "lora": LoRAConfig, "speculative": SpeculativeConfig}
# EngineConfig fields no flag sets: what the derivation itself computes.
DERIVED = {"scheduler.backend_defaults"}
# Options of `serve` / `generate` that are neither engine nor server flags.
OWN_OPTIONS = {"help", "model", "config", "prompt", "chat", "max_tokens", "temperature",
               "top_p", "top_k"}


def parse(*argv):
    return build_parser().parse_args(list(argv))


def lookup(config, path: str):
    for part in path.split("."):
        if config is None:
            return None
        config = getattr(config, part)
    return config


def config_fields() -> set[str]:
    """Every field path of EngineConfig, into the configs it is made of."""
    out = set()
    for f in dataclasses.fields(EngineConfig):
        if f.name in PARTS:
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(PARTS[f.name])}
        else:
            out.add(f.name)
    return out


def test_every_config_field_is_reached_from_a_flag():
    targets = {fl.target for _, fl in flags(EngineArgs) if fl.target}
    fields = config_fields()
    assert {t for t in targets if t not in fields and t not in PARTS} == set()
    covered = {p for p in fields if any(p == t or p.startswith(t + ".") for t in targets)}
    assert fields - covered == DERIVED


def test_every_targeted_flag_reaches_its_config_field():
    named = {f.name for f, fl in flags(EngineArgs) if fl.target}
    assert set(SAMPLES) == named, "give a new flag a sample here"
    default = engine_config_from_args(parse("serve"))
    for name, (given, path, want) in SAMPLES.items():
        if isinstance(given, dict):
            config = engine_config_from_kwargs(**given)
        else:
            ns = parse("serve", *given)
            config = engine_config_from_args(ns)
            if all(fl.llm for f, fl in flags(EngineArgs)
                   if fl.cli and getattr(ns, fl.dest or f.name) != f.default):
                # LLM(**kwargs) with the same arguments: the same config
                assert engine_config_from_kwargs(**engine_kwargs_from_args(ns)) == config, name
        assert lookup(config, path) == want, name
        assert lookup(default, path) != want, name


def test_the_parser_holds_only_declared_flags():
    """A flag added by hand to `serve` or `generate` (not through EngineArgs / FrontendArgs)
    fails here; so does a declared flag the parser lacks."""
    declared = {fl.dest or f.name for cls in (EngineArgs, FrontendArgs)
                for f, fl in flags(cls) if fl.cli}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("serve", "generate"):
        dests = {a.dest for a in sub.choices[command]._actions}
        assert dests - declared - OWN_OPTIONS == set(), command
    serve = {a.dest for a in sub.choices["serve"]._actions}
    assert declared <= serve
    # and the command line's defaults are EngineArgs' defaults: no flag carries its own
    assert EngineArgs.from_cli_args(parse("serve")) == EngineArgs()
    assert engine_config_from_args(parse("serve")) == engine_config_from_kwargs()


def test_help_shows_vllms_groups_with_each_flag_in_its_own(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--help")
    out = capsys.readouterr().out
    titles = re.findall(r"^(\w+):$", out, re.M)
    assert titles == ["options", *GROUPS]  # vLLM's order, Frontend first
    sections = dict(zip(titles, re.split(r"^\w+:$", out, flags=re.M)[1:]))
    for cls in (EngineArgs, FrontendArgs):
        for f, fl in flags(cls):
            if fl.cli:
                assert re.search(rf"^  {re.escape(fl.option(f.name))}\b", sections[fl.group],
                                 re.M), (f.name, fl.group)
    assert "-q {fp8" in sections["ModelConfig"] and "-tp " in sections["ParallelConfig"]


@pytest.mark.parametrize("method", ["qwen3_5_mtp", "qwen3_next_mtp", "deepseek_mtp"])
def test_vllm_spellings_parse_to_the_same_config_as_ours(method):
    ours = engine_config_from_args(parse(
        "serve", "m", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
        "--num-hosts", "2", "--host-index", "1", "--enable-expert-parallel",
        "--quantization", "fp8", "--tensor-parallel-size", "2"))
    theirs = engine_config_from_args(parse(
        "serve", "m", "--speculative-config",
        f'{{"method": "{method}", "num_speculative_tokens": 1}}', "--nnodes", "2",
        "--node-rank", "1", "-ep", "-q", "fp8", "-tp", "2"))
    assert theirs == ours and ours.speculative.method == "mtp"
    spec = {"method": method, "num_speculative_tokens": 1}
    assert engine_config_from_kwargs("m", speculative_config=spec).speculative.method == "mtp"
    with pytest.raises(ValueError, match="speculative_config.method"):
        engine_config_from_kwargs("m", speculative_config={"method": "eagle9",
                                                           "num_speculative_tokens": 1})


def test_vllm_underscore_and_older_spellings(capsys):
    from jaxserve.entrypoints.cli import parse_args

    ours = parse_args(["serve", "m", "--max-model-len", "64", "--no-enable-prefix-caching",
                       "--tensor-parallel-size=2", "--pooler-config", '{"pooling_type": "MEAN"}'])
    theirs = parse_args(["serve", "m", "--max_model_len", "64", "--no_enable_prefix_caching",
                         "--tensor_parallel_size=2", "--override-pooler-config",
                         '{"pooling_type": "MEAN"}'])
    assert engine_config_from_args(theirs) == engine_config_from_args(ours)
    assert engine_config_from_args(ours).scheduler.max_model_len == 64
    with pytest.raises(SystemExit):
        parse_args(["serve", "--no_such_flag", "1"])
    assert "--no_such_flag" in capsys.readouterr().err


def test_llm_refuses_an_unknown_keyword_naming_it():
    from jaxserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="'unknown_kwarg' is not an engine argument"):
        LLM("m", unknown_kwarg=1)  # refused before any model is read
    with pytest.raises(ValueError, match="'max_num_seq'.*did you mean 'max_num_seqs'"):
        engine_config_from_kwargs("m", max_num_seq=4)
    with pytest.raises(ValueError, match="'num_hosts' is a `jaxserve serve` flag \\(--num-hosts"):
        engine_config_from_kwargs("m", num_hosts=2)
    import jaxserve

    assert jaxserve.EngineArgs is EngineArgs  # vLLM's `from vllm import EngineArgs`
    # the older speculative flags are LLM keywords too, as in vLLM's EngineArgs
    c = engine_config_from_kwargs("m", speculative_model="[ngram]", num_speculative_tokens=2)
    assert (c.speculative.method, c.speculative.num_speculative_tokens) == ("ngram", 2)
