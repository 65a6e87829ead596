"""The engine's research controls: weights updated in place, sleep and wake.

``update_weights`` prepares every new leaf first (``worker.weight_update``: a bad source raises
and changes nothing), then swaps them in between steps: at once when nothing runs; with
``in_flight="wait"`` the running requests finish on the old weights while requests that arrive
meanwhile wait, and the swap comes on the first step the engine is idle; with
``in_flight="abort"`` the running requests end at once with finish reason ``abort``. Every swap
forgets the prefix cache (its pages were computed by the old weights).

``sleep(level)`` / ``wake_up(tags)`` release and bring back device memory
(``worker.sleep``); a request that arrives while any tag sleeps is refused (503, as vLLM's
``EngineSleepingError``), and sleeping with requests in flight is refused too.

A mixin of ``LLMEngine``: the engine calls ``_weight_step`` at the start of each core step,
``_admit`` for each checked request and ``_drop_held`` on aborts.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from jaxserve.core.request import RequestStatus
from jaxserve.errors import InvalidRequestError
from jaxserve.worker import sleep as sleep_lib
from jaxserve.worker import weight_update

logger = logging.getLogger(__name__)

IN_FLIGHT_MODES = ("wait", "abort")


class WeightControl:
    """update_weights, sleep, wake_up, is_sleeping of an ``LLMEngine``."""

    _pending_swap: tuple | None = None  # (leaves, source path) waiting for the engine to idle
    _module_vars: list | None = None  # the engine module's variables, in the runner's leaf order
    _held: list | None = None  # requests that arrived while a swap waits
    _weight_outputs: list | None = None  # outputs of requests an update aborted
    _runner_sleep: sleep_lib.RunnerSleep | None = None
    _weights_source: str | None = None  # the last path given to update_weights
    weight_version = 0  # swaps done

    # ---- weights in place ----------------------------------------------------------------
    def update_weights(self, weights, *, in_flight: str = "wait") -> bool:
        """New weights from arrays (used as they are when placed as the engine's) or a path.
        Returns True when swapped now, False when the swap waits for running requests."""
        self._check_runner("update_weights", pipeline_ok=True)
        if in_flight not in IN_FLIGHT_MODES:
            raise InvalidRequestError(f"in_flight: expected one of {IN_FLIGHT_MODES}, got "
                                      f"{in_flight!r}", param="in_flight")
        t0 = time.perf_counter()
        runner = self.runner
        sleeping = self._runner_sleep is not None and "weights" in self._runner_sleep.asleep
        current = self._runner_sleep.weights_abstract if sleeping else runner._state_leaves
        try:
            from jaxserve.models.registry import get_model_class

            kw = dict(model_cls=get_model_class(self.model_config.architecture),
                      model_config=self.model_config)
            if runner.stages is not None:  # pipeline stages: leaves per stage
                leaves = _stage_leaves(runner.stages, weight_update.flat_source(weights), kw)
            else:
                leaves = weight_update.prepare_leaves(
                    runner.param_names(), current, weight_update.flat_source(weights), **kw)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), param="weights") from None
        path = weight_update.describe_source(weights)
        if in_flight == "abort":
            self._abort_for_update()
        if self.scheduler.has_unfinished():
            self._pending_swap = (leaves, path)
            if self._held is None:
                self._held = []
            logger.info("update_weights: %d request(s) finish on the old weights first",
                        len(self.scheduler.requests))
            return False
        self._swap(leaves, path)
        logger.info("update_weights: %d tensors in %.1f ms", len(leaves),
                    1e3 * (time.perf_counter() - t0))
        return True

    def get_weights(self) -> dict:
        """The engine's params by state path (HF name): its own device arrays, no copy (a
        trainer in the same process starts from them). Refused while the weights sleep."""
        if self._runner_sleep is not None and "weights" in self._runner_sleep.asleep:
            raise InvalidRequestError("get_weights: the weights are asleep; wake them up first",
                                      status_code=503, type="service_unavailable")
        return dict(zip(self.runner.param_names(), self.runner._state_leaves))

    def _swap(self, leaves: list, path: str | None) -> None:
        if self.runner.stages is not None:
            self.runner.set_params(leaves)  # the module keeps names only (worker.stages)
        else:
            self.runner.set_params(leaves)
            self._sync_model()
        if self._runner_sleep is not None:
            self._runner_sleep.weights_restored()
        if path is not None:
            self._weights_source = path
        self.weight_version += 1
        self.reset_prefix_cache()

    def _sync_model(self) -> None:
        """The engine's module holds the runner's leaves too, so it keeps no stale (or
        sleeping) arrays alive. Its variables are found once, in leaf order (a graph-wide
        update costs 30 ms for SmolLM2's 272 tensors)."""
        names = self.runner.param_names()
        if self._module_vars is None:
            self._module_vars = [_resolve(self.model, n) for n in names]
        for var, leaf in zip(self._module_vars, self.runner._state_leaves):
            var.set_value(leaf)

    def _abort_for_update(self) -> None:
        """Every request ends now (finish reason ``abort``); their outputs leave with the next
        step."""
        out = self._weight_outputs if self._weight_outputs is not None else []
        for rid in list(self.scheduler.requests):
            req = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                req.drop_pending()
                out.append(req.take_output())
        self._weight_outputs = out
        self._swapped.clear()
        self._swapped_state.clear()
        self._drop_inflight_if_idle()

    def _weight_step(self) -> list:
        """At the start of a core step: outputs of aborted requests, and a waiting swap once the
        engine is idle (then the requests held meanwhile go in)."""
        out, self._weight_outputs = self._weight_outputs or [], None
        if self._pending_swap is not None and not self.scheduler.has_unfinished():
            self._queue.clear()
            leaves, path = self._pending_swap
            self._pending_swap = None
            self._swap(leaves, path)
            held, self._held = self._held or [], None
            for req in held:
                self.scheduler.add_request(req)
        return out

    def _admit(self, req) -> None:
        """A checked request into the scheduler, or held while a swap waits."""
        self._check_awake()
        if self._held is not None:
            self._held.append(req)
        else:
            self.scheduler.add_request(req)

    def _drop_held(self, request_ids) -> None:
        if self._held:
            ids = set(request_ids)
            self._held = [r for r in self._held if r.request_id not in ids]

    def _weights_busy(self) -> bool:
        """Something for the next core step to do: held requests or aborted outputs."""
        return bool(self._held) or bool(self._weight_outputs) or self._pending_swap is not None

    # ---- sleep and wake -------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release device memory: the KV pool and (level 1) the weights to host memory, or
        (level 2) the weights dropped. Refused while requests run or buckets compile."""
        self._check_runner("sleep")
        if level not in (1, 2):
            raise InvalidRequestError(f"level: expected 1 or 2, got {level!r}", param="level")
        if self.has_unfinished_requests():
            raise InvalidRequestError(
                f"sleep: {self.get_num_unfinished_requests() or len(self.scheduler.requests)} "
                "request(s) are in flight; finish or abort them first", param="level",
                status_code=409, type="conflict")
        if self.runner._warmup is not None and not self.runner.warmed_up:
            self.runner._warmup.pool.wait_all()  # compile jobs run steps on the pool
        t0 = time.perf_counter()
        self.reset_prefix_cache()  # the pool's pages are gone
        if self._runner_sleep is None:
            self._runner_sleep = sleep_lib.RunnerSleep()
        self._runner_sleep.sleep(self.runner, level)
        self._sync_model()
        self._last_sleep_s = time.perf_counter() - t0
        logger.info("sleep(level=%d) in %.1f ms: %s released", level, 1e3 * self._last_sleep_s,
                    " and ".join(sorted(self._runner_sleep.asleep)))

    def wake_up(self, tags=None) -> None:
        """Bring back the tags named ("weights", "kv_cache"; all when None)."""
        self._check_runner("wake_up")
        try:
            tags = sleep_lib.check_tags(tags)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="tags") from None
        if self._runner_sleep is None:
            return
        t0 = time.perf_counter()
        self._runner_sleep.wake_up(self.runner, tags, reload=self._reload_weights)
        self._sync_model()
        logger.info("wake_up(%s) in %.1f ms", ",".join(tags), 1e3 * (time.perf_counter() - t0))

    def is_sleeping(self) -> bool:
        return self._runner_sleep is not None and bool(self._runner_sleep.asleep)

    def _check_awake(self) -> None:
        if self.is_sleeping():
            raise InvalidRequestError(
                f"the engine is sleeping ({', '.join(sorted(self._runner_sleep.asleep))} "
                "released); wake it up first (LLM.wake_up, POST /wake_up)",
                status_code=503, type="service_unavailable")

    def _reload_weights(self, abstract: list) -> list:
        """A level-2 wake's weights: the last path given to update_weights, else the model the
        engine started with (loaded as at start)."""
        names = self.runner.param_names()
        from jaxserve.models.registry import get_model_class

        cls = get_model_class(self.model_config.architecture)
        if self._weights_source is not None:
            src = weight_update.path_source(Path(self._weights_source))
        else:
            from jaxserve.loaders.model_loader import load_model

            c = self.config
            spec = c.speculative
            model, _, _ = load_model(
                c.model, dtype=c.dtype, load_format=c.load_format,
                attention_backend=c.attention_backend, mesh=self.mesh,
                enable_expert_parallel=c.parallel.enable_expert_parallel,
                quantization=c.quantization, lm_head_quantized=c.lm_head_quantized,
                load_mtp=spec is not None and spec.method == "mtp", **c.model_source())
            src = weight_update.flat_source(model)
        logger.info("wake_up: weights reloaded from %s", self._weights_source or self.config.model)
        return weight_update.prepare_leaves(names, abstract, src, model_cls=cls,
                                            model_config=self.model_config)

    def _check_runner(self, what: str, pipeline_ok: bool = False) -> None:
        from jaxserve.worker.runner import ModelRunner

        if type(self.runner) is not ModelRunner or (self.runner.stages is not None
                                                    and not pipeline_ok):
            raise InvalidRequestError(f"{what} is not supported with pipeline parallelism yet",
                                      param="pipeline_parallel_size")
        if self.config.parallel.num_hosts > 1:  # followers replay steps, not weight swaps
            raise InvalidRequestError(f"{what} runs on one host (the engine spans "
                                      f"{self.config.parallel.num_hosts})", param="num_hosts")


def _resolve(model, name: str):
    """The module's variable at a state path (``model.layers.0.mlp.up_proj.weight``)."""
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _stage_leaves(stages, source, kw: dict) -> list[list]:
    """Each pipeline stage's new leaves: every tensor checked and placed once (on the first
    stage holding it), then on each other stage holding it too (a tied LM head's copy)."""
    names, current = [], []
    for stage_names, leaves in zip(stages.param_names(), stages.stage_leaves):
        for n, x in zip(stage_names, leaves):
            if n not in names:
                names.append(n)
                current.append(x)
    placed = dict(zip(names, weight_update.prepare_leaves(names, current, source, **kw)))
    return [[weight_update.place(placed[n], x) for n, x in zip(stage_names, leaves)]
            for stage_names, leaves in zip(stages.param_names(), stages.stage_leaves)]
