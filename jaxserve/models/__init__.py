"""Flax NNX models; :mod:`jaxserve.models.registry` maps HF ``architectures`` to classes."""
