"""What each rollout engine states about its memory: the options the memory plan reads of it and the ones it plans.

``qerl.run.resolve`` reads an engine's settings from its config through its engine class's ``settings`` type (never
from the constructor's signature) and makes every planned value concrete before the engine is built. An engine built
in code without a plan gets its planned values from ``unplanned`` (documented below), once, in its constructor; no
engine decides one of them while it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass(frozen=True)
class EngineSettings:
    """An engine with nothing to plan (``BuiltinRollout``: transformers' growing cache, freed after each rollout)."""

    PLANNED: ClassVar[tuple[str, ...]] = ()  # the fields the plan decides where the config leaves them open (None)

    @classmethod
    def of(cls, init_args: Mapping | None) -> EngineSettings:
        """The settings of a parsed ``model.rollout.init_args`` (the config's values over the defaults)."""
        given = dict(init_args.items()) if init_args is not None else {}
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})

    def open(self) -> tuple[str, ...]:
        """The planned fields the config leaves to the plan."""
        return tuple(name for name in self.PLANNED if getattr(self, name) is None)


@dataclass(frozen=True)
class GraphEngineSettings(EngineSettings):
    """``CUDAGraphRollout``'s (see its arguments): the cache's length bucket and element type are read; the wave, the
    bf16 weight copy of wide steps and whether the KV cache stays through the update are planned."""

    PLANNED: ClassVar[tuple[str, ...]] = ("wave_rows", "wide_batch_bf16", "keep_kv_cache")

    length_bucket: int = 256
    kv_cache_dtype: str = "auto"
    check_every: int = 16
    turn_check_every: int | None = None  # a multi-turn wave's (None: check_every)
    wave_rows: int | None = None  # after resolution None means every row in one wave
    wide_batch_bf16: bool | None = None
    keep_kv_cache: bool | None = None

    @staticmethod
    def unplanned() -> dict:
        """The planned values of an engine no plan was made for (no device, a model the plan does not know, an
        evaluation run, an engine built in code): every row in one wave, no bf16 weight copy (it needs memory
        nobody counted), the KV cache kept between rollouts (nothing counted the update's memory either)."""
        return {"wave_rows": None, "wide_batch_bf16": False, "keep_kv_cache": True}


UNPLANNED_UTILIZATION = 0.4  # vLLM's share when no memory plan chose one (an engine built outside train.py fit)


@dataclass(frozen=True)
class VLLMEngineSettings(EngineSettings):
    """``VLLMRollout``'s (see its arguments): the LoRA slot, sleeping and vLLM's own options are read; vLLM's share of
    the GPU and its longest row are planned."""

    PLANNED: ClassVar[tuple[str, ...]] = ("gpu_memory_utilization", "max_model_len")

    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_lora_rank: int | None = None
    sleep: bool = True
    engine_kwargs: dict | None = None

    @staticmethod
    def unplanned() -> dict:
        """vLLM's share of the GPU without a plan; the longest row is the run's (``resolve`` needs no device for it),
        or vLLM's own limit for the model where an engine is built in code."""
        return {"gpu_memory_utilization": UNPLANNED_UTILIZATION}
