"""Multi-host engines: the leader's AsyncLLM (its shutdown also stops the followers) and a
follower's replay loop, both over the worker's step channel (``jaxserve.worker.multihost``)."""
from __future__ import annotations

import logging

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.builder import build_engine
from jaxserve.worker.multihost import Leader, check_config, follow

logger = logging.getLogger(__name__)


def make_leader_async_llm(config):
    """The leader's ``AsyncLLM``, whose shutdown also stops the followers."""
    check_config(config)
    engine = build_engine(config)
    leader = Leader(engine)

    class LeaderAsyncLLM(AsyncLLM):
        async def shutdown(self) -> None:
            await super().shutdown()
            leader.stop()

    llm = LeaderAsyncLLM(config, engine=engine)
    llm.leader = leader
    return llm


def run_follower(config) -> int:
    check_config(config)
    engine = build_engine(config)
    logger.info("follower %d ready; replaying the leader's steps", config.parallel.host_index)
    return follow(engine)
