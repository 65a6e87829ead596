"""Mesh and partition specs (a leaf: models, loaders and worker import it). Tensor parallelism
over a ``jax.sharding.Mesh``: the mesh, the KV pool layout, and the
``shard_map`` that runs the attention kernel once per shard.

One mesh axis, ``tp`` (tensor parallel), spans the devices of one engine replica; data-parallel
replicas are separate engines on disjoint device subsets (``jaxserve.engine.data_parallel``), so no replica needs a
``data`` axis. Parameters follow Megatron (``loader.param_partition_spec``): q/k/v and gate/up
split their output rows, o/down their input columns (XLA inserts the all-reduce), embedding and
LM head split the vocabulary, norms are replicated. Logits leave the step replicated (one
all-gather on device) and are sampled on device.

Pipeline parallel: a second axis, ``pp``, stacks ``pipeline_parallel_size`` stages of ``tp``
devices each (``pipeline_mesh``); stage *i* is the ``tp`` mesh of row *i* (``stage_meshes``) and
runs its own jitted programs on its own layers, KV pages and weights
(``jaxserve.worker.stages``).

KV pool: ``[Hkv_pool, pages, block, D]`` sharded over its head axis. When ``tp`` exceeds the
model's KV heads, each KV head is repeated ``tp // Hkv`` times (``Hkv_pool = tp``) so every
device owns the one KV head its query heads read, as vLLM does; k/v projections are then
replicated. The scheduler and block manager see one logical pool either way.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"
PP_AXIS = "pp"
# Set to 1 to run tp=1 through the mesh path (shard_map, pinned shardings): a benchmark knob.
FORCE_MESH_ENV = "JAXSERVE_FORCE_MESH"


def default_mesh() -> Mesh:
    """A 1-device mesh with the tensor-parallel axis (size 1)."""
    return Mesh(np.array(jax.devices()[:1]), (TP_AXIS,))


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D ``tp`` mesh over the first ``tensor_parallel_size`` of ``devices`` (all by default)."""
    from jaxserve.errors import InvalidRequestError

    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise InvalidRequestError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
            f"{len(devices)} available", param="tensor_parallel_size")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def pipeline_mesh(pipeline_parallel_size: int, tensor_parallel_size: int, devices=None) -> Mesh:
    """The ``(pp, tp)`` mesh: stage *i* is row *i*, ``tp`` consecutive devices (a node's NVLink
    group on a GPU host), the stages in device order (hosts in process order)."""
    from jaxserve.errors import InvalidRequestError

    devices = list(jax.devices() if devices is None else devices)
    pp, tp = pipeline_parallel_size, tensor_parallel_size
    if pp < 1 or tp < 1 or pp * tp > len(devices):
        raise InvalidRequestError(
            f"--pipeline-parallel-size {pp} x --tensor-parallel-size {tp} "
            f"(pipeline_parallel_size x tensor_parallel_size) needs {pp * tp} devices; "
            f"{len(devices)} available", param="pipeline_parallel_size")
    return Mesh(np.array(devices[:pp * tp]).reshape(pp, tp), (PP_AXIS, TP_AXIS))


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """The ``tp`` mesh of each pipeline stage (a row of the ``(pp, tp)`` mesh)."""
    return [Mesh(row, (TP_AXIS,)) for row in mesh.devices]


def tp_size(mesh: Mesh | None) -> int:
    if mesh is None or TP_AXIS not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.devices.shape))[TP_AXIS])


def engine_mesh(parallel_config, devices=None) -> Mesh | None:
    """The mesh an engine serves on, or None for the plain single-device path (tp=1)."""
    tp = parallel_config.tensor_parallel_size
    if tp == 1 and devices is None and os.environ.get(FORCE_MESH_ENV, "0") in ("", "0"):
        return None
    return make_mesh(tp, devices)


def check_model(model_config, tp: int) -> None:
    """Heads must split evenly: query heads by ``tp``; KV heads by ``tp`` or ``tp`` by them."""
    from jaxserve.errors import InvalidRequestError

    hq, hkv = model_config.num_heads, model_config.num_kv_heads
    if hq % tp:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={hq}",
            param="tensor_parallel_size")
    if hkv % tp and tp % hkv:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} and num_key_value_heads={hkv} must divide one another",
            param="tensor_parallel_size")
    for key in ("linear_num_key_heads", "linear_num_value_heads"):  # Gated DeltaNet heads
        n = (getattr(model_config, "hf", None) or {}).get(key)
        if n is not None and int(n) % tp:
            raise InvalidRequestError(f"tensor_parallel_size={tp} must divide {key}={n}",
                                      param="tensor_parallel_size")


def pool_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads in the page pool: the model's, or ``tp`` when each device needs its own copy."""
    return max(num_kv_heads, tp)


def shard_kv_projections(num_kv_heads: int, tp: int) -> bool:
    """k/v projections split by head only when every device gets whole, distinct heads."""
    return num_kv_heads % tp == 0


def agree_across_hosts(num_pages: int) -> int:
    """Multi-host: every process must allocate the same global pool; take the smallest fit."""
    if jax.process_count() == 1:
        return num_pages
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(num_pages))))


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(TP_AXIS))


def state_pool_sharding(mesh: Mesh) -> NamedSharding:
    """A state pool ``[slots, C or H, ...]``: split over its channel/head axis, as the layers
    that own it split their heads."""
    return NamedSharding(mesh, PartitionSpec(None, TP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older JAX

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def sharded_attention(fn, mesh: Mesh):
    """``fn(q, k, v, k_pages, v_pages, md) -> (out, k_pages, v_pages)`` run per shard: q/k/v
    ``[T, H, D]`` and the pages split over heads, the metadata replicated."""
    heads = PartitionSpec(None, TP_AXIS, None)
    pages = PartitionSpec(TP_AXIS)
    return _shard_map(fn, mesh, in_specs=(heads, heads, heads, pages, pages, PartitionSpec()),
                      out_specs=(heads, pages, pages))
