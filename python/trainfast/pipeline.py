"""Pipeline / virtual-pipeline layer splits: Megatron's offsets and layout strings, uneven VPP, Paddle's
segmentation, and cost-balanced layouts.

A split of ``num_layers`` decoder layers over ``pp`` pipeline ranks with ``vpp`` virtual stages each
has ``pp * vpp`` chunks in global layer order: chunk ``c`` runs on pipeline rank ``c % pp`` as its
virtual stage ``c // pp``. Plans are dicts ``{(pp_rank, vp_stage): range(first_layer, end_layer)}``
listed in that order; every plan returned here covers every layer exactly once, in order.

>>> from trainfast.pipeline import plan_layers, to_layout_str
>>> plan = plan_layers(7, 2, 2, method="megatron", account_for_loss_in_pipeline_split=True)
>>> [(key, list(layers)) for key, layers in plan.items()]
[((0, 0), [0, 1]), ((1, 0), [2, 3]), ((0, 1), [4, 5]), ((1, 1), [6])]
>>> to_layout_str(plan, 2, 2)
'Ett|tt|tt|tL'
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Literal, Optional

import numpy as np

from trainfast import _core
from trainfast._util import UpstreamAssertionError, as_array, check_bool, check_choice, check_int, to_tensor

__all__ = [
    "BalancedLayout",
    "PipelineLayout",
    "balanced_layout",
    "chunk_costs",
    "get_num_layers_to_build",
    "get_transformer_layer_offset",
    "plan_layers",
    "to_layout_str",
]

logger = logging.getLogger(__name__)

Plan = dict  # {(pp_rank, vp_stage): range}
Method = Literal["megatron", "uneven", "paddle"]
_METHODS = ("megatron", "uneven", "paddle")

# Megatron's LayerType names and the layout-string characters that stand for them.
_TYPE_CHARS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
_CHAR_NAMES = {char: name for name, char in _TYPE_CHARS.items()}


# Every int crossing into the native planner is first bounded here, so its int64 sums and products
# cannot overflow; the planner then applies its own tighter bounds (2^40 layers, 2^22 chunks) and
# names the argument. No real model comes near either.
_LIMIT = 2**60
_MAX_CHUNKS = 2**22  # pp * vpp


def _check_int(value: Any, name: str, *, min_value: int | None = None) -> int:
    value = check_int(value, name, min_value=min_value)
    if not -_LIMIT < value < _LIMIT:
        raise ValueError(f"{name} must be in (-2^60, 2^60) (got {value})")
    return value


def _layout_text(text: str, name: str) -> str:
    """``text`` with Unicode decimal digits as ASCII ones: Megatron reads repeat counts with ``re``'s
    ``\\d`` and ``int()``, which take any of them ("Et*３" is "Et*3")."""
    if text.isascii():
        return text
    text = "".join(str(unicodedata.decimal(char)) if char.isdecimal() else char for char in text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} has an invalid layer character {text[error.start]!r}") from None
    return text


def _layer_char(layer_type: Any) -> str:
    """'t' for "decoder", "t" or megatron's LayerType.decoder (anything with that .name)."""
    name = getattr(layer_type, "name", layer_type)
    if isinstance(name, str):
        key = name.strip()
        if key in _CHAR_NAMES:
            return key
        if key.lower() in _TYPE_CHARS:
            return _TYPE_CHARS[key.lower()]
    raise ValueError(
        f"layer_type must be one of {', '.join(map(repr, _TYPE_CHARS))} or a layout character "
        f"E/t/m/L (got {layer_type!r})"
    )


def _current_pp_rank() -> int:
    """Megatron's pipeline rank, as upstream reads it when pp_rank is None."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        raise UpstreamAssertionError("pp_rank must be given: megatron.core.parallel_state is not loaded")
    try:
        return _check_int(parallel_state.get_pipeline_model_parallel_rank(), "pp_rank", min_value=0)
    except (AssertionError, RuntimeError, AttributeError) as error:
        raise UpstreamAssertionError(f"pp_rank must be given: Megatron's parallel state is not initialized "
                                     f"({error})") from None


def _optional_int(value: Any, name: str, *, min_value: int | None = None) -> Optional[int]:
    return None if value is None else _check_int(value, name, min_value=min_value)


def _plan_dict(counts: np.ndarray, offsets: np.ndarray, pp: int) -> Plan:
    plan = {}
    for chunk, (count, offset) in enumerate(zip(counts.tolist(), offsets.tolist())):
        plan[(chunk % pp, chunk // pp)] = range(offset, offset + count)
    return plan


# --------------------------------------------------------------------------------------------------
# Layout strings


class PipelineLayout:
    """Megatron's ``PipelineParallelLayerLayout``: which layers each (pp_rank, vp_stage) holds.

    ``stages[c]`` is the expanded stage string (e.g. ``"Ettt"``) of chunk ``c`` in global order, i.e.
    of pipeline rank ``c % pp`` at virtual stage ``c // pp``. Layers are numbered in that order; with
    ``pp == 1`` and several virtual stages Megatron would number each from 0 instead (its layer
    offset is 0), which the drop-ins and :func:`to_layout_str` refuse.
    """

    __slots__ = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "stages", "_counts")

    def __init__(self, stages: Sequence[str | Sequence[Any]], pipeline_model_parallel_size: int):
        pp = _check_int(pipeline_model_parallel_size, "pipeline_model_parallel_size", min_value=1)
        if isinstance(stages, str) or not isinstance(stages, Sequence):
            raise TypeError(f"stages must be a sequence of stage strings (got {type(stages).__name__})")
        stage_list = [_layout_text(str(stage), f"stages[{i}]") if isinstance(stage, str)
                      else _stage_from_types(stage, i) for i, stage in enumerate(stages)]
        _core.pipeline_layout_counts(stage_list, pp, "t")  # checks characters and the pp multiple
        self.pipeline_model_parallel_size = pp
        self.virtual_pipeline_model_parallel_size = len(stage_list) // pp
        self.stages = tuple(stage_list)
        self._counts: dict[str, tuple[list[int], list[int]]] = {}

    # from_str hands every caller of one string the same cached object: an edit by one would
    # change the others' layout (and leave its cached counts stale).
    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name):
            raise AttributeError(f"PipelineLayout is immutable: cannot set {name} (make a new one)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"PipelineLayout is immutable: cannot delete {name}")

    # -- construction ------------------------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=256)
    def _parse(layout: str, pp: int) -> PipelineLayout:
        return PipelineLayout(_core.pipeline_parse_layout(layout, pp), pp)

    @classmethod
    def from_str(
        cls,
        layout: str,
        pipeline_model_parallel_size: int,
        *,
        num_layers: int | None = None,
        mtp_num_layers: int | None = None,
        validate: bool = True,
    ) -> PipelineLayout:
        """Parses a layout string exactly as Megatron does (``,`` ignored, ``(X)*n`` then ``c*n``
        unrolled, split on ``|`` into ``pp * vpp`` stages in vpp-major order).

        With ``validate`` (default) it also checks what Megatron's ``validate_layer_layout`` checks
        without knowing the model: E first and once, L last and once, decoders before MTP, MTP only
        in a rank's last virtual stage and all in one stage; given ``num_layers``, the decoder count
        too, and with it ``mtp_num_layers`` the MTP count (``mtp_num_layers`` alone is not checked).
        Raises ValueError saying what is wrong.
        """
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str (got {type(layout).__name__})")
        pp = _check_int(pipeline_model_parallel_size, "pipeline_model_parallel_size", min_value=1)
        validate = check_bool(validate, "validate")
        parsed = cls._parse(_layout_text(layout, "layout"), pp)
        if validate:
            parsed.validate(num_layers, mtp_num_layers, check_counts=num_layers is not None)
        return parsed

    @classmethod
    def from_list(cls, layout: Sequence[Sequence[Any]], pipeline_model_parallel_size: int) -> PipelineLayout:
        """From Megatron's list form: ``pp * vpp`` lists (global order) of LayerType or names."""
        return cls(list(layout), pipeline_model_parallel_size)

    @classmethod
    def from_megatron(cls, layout: Any) -> PipelineLayout:
        """From a ``megatron.core...PipelineParallelLayerLayout`` (its 2-D ``layout[pp][vpp]``)."""
        if not all(hasattr(layout, f) for f in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "layout")):
            raise TypeError(f"layout must be a megatron PipelineParallelLayerLayout (got {type(layout).__name__})")
        pp = _check_int(layout.pipeline_model_parallel_size, "pipeline_model_parallel_size", min_value=1)
        vpp = _check_int(layout.virtual_pipeline_model_parallel_size, "virtual_pipeline_model_parallel_size", min_value=1)
        rows = layout.layout
        return cls([_stage_from_types(rows[c % pp][c // pp], c) for c in range(pp * vpp)], pp)

    # -- queries -----------------------------------------------------------------------------------
    def _layer_counts(self, layer_type: Any) -> tuple[list[int], list[int]]:
        char = _layer_char(layer_type)
        if char not in self._counts:
            counts, offsets = _core.pipeline_layout_counts(list(self.stages), self.pipeline_model_parallel_size, char)
            self._counts[char] = (counts.tolist(), offsets.tolist())
        return self._counts[char]

    def _chunk(self, vp_stage: Any, pp_rank: Any) -> int:
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        pp_rank = _current_pp_rank() if pp_rank is None else _check_int(pp_rank, "pp_rank")
        if not 0 <= pp_rank < pp:
            raise ValueError(f"pp_rank must be in [0, {pp}) (got {pp_rank})")
        if vp_stage is None:
            if vpp > 1:
                raise UpstreamAssertionError(
                    f"vp_stage must be passed if virtual pipeline is enabled (the layout has vpp={vpp})"
                )
            vp_stage = 0
        vp_stage = _check_int(vp_stage, "vp_stage")
        if not 0 <= vp_stage < vpp:
            raise ValueError(f"vp_stage must be in [0, {vpp}) (got {vp_stage})")
        return vp_stage * pp + pp_rank

    def num_layers_to_build(self, layer_type: Any = "decoder", vp_stage: int | None = None, pp_rank: int | None = None) -> int:
        """Number of ``layer_type`` layers on (pp_rank, vp_stage) (upstream ``get_num_layers_to_build``)."""
        return self._layer_counts(layer_type)[0][self._chunk(vp_stage, pp_rank)]

    def layer_offset(self, layer_type: Any = "decoder", vp_stage: int | None = None, pp_rank: int | None = None) -> int:
        """Number of ``layer_type`` layers in all earlier chunks (upstream ``get_layer_offset``)."""
        return self._layer_counts(layer_type)[1][self._chunk(vp_stage, pp_rank)]

    def layer_ids(self, layer_type: Any = "decoder", vp_stage: int | None = None, pp_rank: int | None = None) -> list[int]:
        chunk = self._chunk(vp_stage, pp_rank)
        counts, offsets = self._layer_counts(layer_type)
        return list(range(offsets[chunk], offsets[chunk] + counts[chunk]))

    # Upstream's getter names, so a PipelineLayout answers these three calls like Megatron's object
    # (only these: its .layout holds characters, not LayerType lists, and it has no validate_layer_layout).
    get_num_layers_to_build = num_layers_to_build
    get_layer_offset = layer_offset
    get_layer_id_list = layer_ids

    def plan(self, layer_type: Any = "decoder") -> Plan:
        """``{(pp_rank, vp_stage): range}`` of ``layer_type`` layers, in global chunk order."""
        counts, offsets = self._layer_counts(layer_type)
        return _plan_dict(np.asarray(counts), np.asarray(offsets), self.pipeline_model_parallel_size)

    def validate(self, num_layers: int | None = None, mtp_num_layers: int | None = None, *, check_counts: bool = True) -> bool:
        """Megatron's ``validate_layer_layout``; returns ``mtp_standalone``. Raises ValueError."""
        num_layers = _optional_int(num_layers, "num_layers", min_value=0)
        mtp_num_layers = _optional_int(mtp_num_layers, "mtp_num_layers", min_value=0)
        return _core.pipeline_validate_layout(
            list(self.stages), self.pipeline_model_parallel_size, num_layers, mtp_num_layers,
            check_counts and num_layers is not None,
        )

    @property
    def layout(self) -> list[list[str]]:
        """Megatron's 2-D form: ``layout[pp_rank][vp_stage]`` is that stage's string."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        return [[self.stages[v * pp + p] for v in range(vpp)] for p in range(pp)]

    def to_str(self) -> str:
        """A short layout string that parses back to the same stages, e.g. ``Et*3|(tt|)*29,m|L``."""
        return _core.pipeline_layout_to_str(list(self.stages), self.pipeline_model_parallel_size)

    def __str__(self) -> str:
        return self.to_str()

    def __repr__(self) -> str:
        return f"PipelineLayout.from_str({self.to_str()!r}, {self.pipeline_model_parallel_size})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipelineLayout):
            return NotImplemented
        return self.pipeline_model_parallel_size == other.pipeline_model_parallel_size and self.stages == other.stages

    def __hash__(self) -> int:
        return hash((self.pipeline_model_parallel_size, self.stages))


def _stage_from_types(stage: Any, index: int) -> str:
    if isinstance(stage, str):
        return stage
    if isinstance(stage, (bytes, Mapping)) or not isinstance(stage, Sequence):
        raise TypeError(f"layout stage {index} must be a list of layer types (got {type(stage).__name__})")
    chars = []
    for layer_type in stage:
        name = getattr(layer_type, "name", layer_type)
        if not isinstance(name, str) or name.strip().lower() not in _TYPE_CHARS:
            raise ValueError(
                f"layout stage {index} has {layer_type!r}, which is not a supported layer type "
                f"({', '.join(_TYPE_CHARS)})"
            )
        chars.append(_TYPE_CHARS[name.strip().lower()])
    return "".join(chars)


# --------------------------------------------------------------------------------------------------
# Megatron drop-ins


# (num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss): the native planner's
# arguments; then the layout and mtp_num_layers.
_MegatronArgs = tuple[int, int, Optional[int], Optional[int], Optional[int], bool, bool]
_ConfigSpec = tuple[int, int, Optional[int], Optional[int], Optional[int], bool, bool, Optional[PipelineLayout],
                    Optional[int]]


def _read_config(config: Any) -> _ConfigSpec:
    def field(name: str, default: Any = None) -> Any:
        return getattr(config, name, default)

    if not hasattr(config, "num_layers"):
        raise TypeError(f"config must have a num_layers field like a TransformerConfig (got {type(config).__name__})")
    num_layers = _check_int(field("num_layers"), "config.num_layers", min_value=0)
    pp = _check_int(field("pipeline_model_parallel_size", 1), "config.pipeline_model_parallel_size", min_value=1)
    vpp = _optional_int(field("virtual_pipeline_model_parallel_size"), "config.virtual_pipeline_model_parallel_size", min_value=1)
    first = _optional_int(field("num_layers_in_first_pipeline_stage"), "config.num_layers_in_first_pipeline_stage")
    last = _optional_int(field("num_layers_in_last_pipeline_stage"), "config.num_layers_in_last_pipeline_stage")
    account_for_embedding = bool(field("account_for_embedding_in_pipeline_split", False))
    account_for_loss = bool(field("account_for_loss_in_pipeline_split", False))
    mtp_num_layers = _optional_int(field("mtp_num_layers"), "config.mtp_num_layers", min_value=0)
    layout = _config_layout(field("pipeline_model_parallel_layout"), pp)
    return (num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout, mtp_num_layers)


def _config_layout(value: Any, pp: int) -> Optional[PipelineLayout]:
    if value is None:
        return None
    if isinstance(value, PipelineLayout):
        layout = value
    elif isinstance(value, str):
        layout = PipelineLayout.from_str(value, pp, validate=False)
    elif isinstance(value, list):
        layout = PipelineLayout.from_list(value, pp)
    elif hasattr(value, "layout") and hasattr(value, "pipeline_model_parallel_size"):
        layout = PipelineLayout.from_megatron(value)
    else:
        raise TypeError(
            "config.pipeline_model_parallel_layout must be a str, a list of stages or a PipelineLayout "
            f"(got {type(value).__name__})"
        )
    if layout.pipeline_model_parallel_size != pp:
        raise ValueError(
            f"config.pipeline_model_parallel_layout is for pipeline_model_parallel_size="
            f"{layout.pipeline_model_parallel_size}, but the config has {pp}"
        )
    return layout


@functools.lru_cache(maxsize=1024)
def _validate_layout_config(spec: tuple) -> None:
    """TransformerConfig's checks of a config with a layout, plus the offsets upstream would compute."""
    num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss, layout, mtp_num_layers = spec
    if first is not None or last is not None or account_for_embedding or account_for_loss:
        raise UpstreamAssertionError(
            "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
            f"(num_layers_in_first_pipeline_stage={first}, num_layers_in_last_pipeline_stage={last}, "
            f"account_for_embedding_in_pipeline_split={account_for_embedding}, "
            f"account_for_loss_in_pipeline_split={account_for_loss})"
        )
    detected = layout.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp != detected:
        raise UpstreamAssertionError(
            f"virtual_pipeline_model_parallel_size ({vpp}) conflicts with pipeline_model_parallel_layout, "
            f"which has {detected} virtual stages"
        )
    try:
        layout.validate(num_layers, mtp_num_layers)
    except ValueError as error:
        raise UpstreamAssertionError(str(error)) from None
    if pp == 1 and detected > 1:
        counts, offsets = layout._layer_counts("t")
        doubled = [c for c in range(len(counts)) if counts[c] and offsets[c]]
        if doubled:
            first_bad = doubled[0]
            raise UpstreamAssertionError(
                "with pipeline_model_parallel_size=1 Megatron's get_transformer_layer_offset is 0 for every "
                f"virtual stage, so the layers of vp_stage {first_bad} (layers {offsets[first_bad]}-"
                f"{offsets[first_bad] + counts[first_bad] - 1}) would be numbered as layers 0-{counts[first_bad] - 1} again"
            )


def _megatron_args(spec: _ConfigSpec) -> _MegatronArgs:
    return spec[:7]


def _rank_values(config: Any, vp_stage: Any, pp_rank: Any) -> tuple[int, Optional[int]]:
    spec = _read_config(config)
    layout = spec[7]
    if layout is not None:
        _validate_layout_config(spec)
        return layout.num_layers_to_build("t", vp_stage, pp_rank), (
            layout.layer_offset("t", vp_stage, pp_rank) if spec[1] > 1 else 0
        )
    pp_rank = _current_pp_rank() if pp_rank is None else _check_int(pp_rank, "pp_rank")
    vp_stage = _optional_int(vp_stage, "vp_stage")
    try:
        return _core.pipeline_megatron_rank(*_megatron_args(spec), pp_rank, vp_stage)
    except ValueError as error:
        raise UpstreamAssertionError(str(error)) from None


_CONFIG_FIELD_NAMES = (
    "num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
)
_CONFIG_FIELDS = operator.attrgetter(
    "num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
)


@functools.lru_cache(maxsize=256)
def _rank_table(fields: tuple) -> dict:
    """{(pp_rank, vp_stage): (num_layers_to_build, offset)} of a config without layout (validated)."""
    spec = _read_config(SimpleNamespace(**dict(zip(_CONFIG_FIELD_NAMES, fields))))
    try:
        counts, offsets = _core.pipeline_megatron_plan(*_megatron_args(spec))
    except ValueError as error:
        raise UpstreamAssertionError(str(error)) from None
    pp = spec[1]
    return {(c % pp, c // pp): (count, offset) for c, (count, offset) in enumerate(zip(counts.tolist(), offsets.tolist()))}


def _fast_lookup(config: Any, vp_stage: Any, pp_rank: Any) -> Optional[tuple[int, int]]:
    """The cached (count, offset) when both ranks are given as ints and there is no layout."""
    if type(pp_rank) is not int or type(vp_stage) is not int:
        return None
    try:
        fields = _CONFIG_FIELDS(config)
        if fields[7] is not None:
            return None
        for value in fields[:5]:  # 2.0 == 2 would share a cache entry; such values take the checked path
            if value is not None and type(value) is not int:
                return None
        return _rank_table(fields).get((pp_rank, vp_stage))
    except (AttributeError, TypeError):  # missing fields take defaults, unhashable ones are checked
        return None


def get_num_layers_to_build(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Drop-in for ``megatron.core.transformer.transformer_block.get_num_layers_to_build``.

    Args:
        config: a ``TransformerConfig`` or any object with its pipeline fields (``num_layers``,
            ``pipeline_model_parallel_size``, ``virtual_pipeline_model_parallel_size``,
            ``num_layers_in_first/last_pipeline_stage``, ``account_for_embedding/loss_in_pipeline_split``,
            ``pipeline_model_parallel_layout``, ``mtp_num_layers``; missing ones take upstream defaults).
        vp_stage: virtual pipeline stage (required with a multi-stage layout).
        pp_rank: pipeline rank; ``None`` reads Megatron's initialized parallel state as upstream does.

    Returns the same count as upstream for every config upstream accepts and that builds every layer
    exactly once. Everything upstream asserts or rejects in ``TransformerConfig`` raises
    :class:`~trainfast._util.UpstreamAssertionError` (a ValueError and AssertionError) saying which
    layers would be lost; so do splits upstream would silently get wrong (e.g. vpp with pp=1).
    With a layout, upstream ignores ``pp_rank`` and reads the global rank; here a given ``pp_rank``
    is used (the same whenever it is the caller's rank).
    """
    hit = _fast_lookup(config, vp_stage, pp_rank)
    if hit is not None:
        return hit[0]
    return _rank_values(config, vp_stage, pp_rank)[0]


def get_transformer_layer_offset(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Drop-in for ``megatron.core.transformer.transformer_layer.get_transformer_layer_offset``.

    Same arguments and validation as :func:`get_num_layers_to_build`. Where upstream divides by zero
    (uneven first *and* last stage with vpp and pp=2), this returns the offset its formula means.
    """
    hit = _fast_lookup(config, vp_stage, pp_rank)
    if hit is not None:
        return hit[1]
    spec = _read_config(config)
    if spec[7] is not None and spec[1] == 1:
        # Upstream's offset on one pipeline rank is 0 without reading vp_stage (which a multi-stage
        # layout would need for the count); it does read the parallel state when pp_rank is None.
        if pp_rank is None:
            _current_pp_rank()
        _validate_layout_config(spec)
        return 0
    offset = _rank_values(config, vp_stage, pp_rank)[1]
    if offset is None:
        raise UpstreamAssertionError(
            "vp_stage must be provided if virtual pipeline model parallel size is set "
            f"(config.virtual_pipeline_model_parallel_size={getattr(config, 'virtual_pipeline_model_parallel_size', None)})"
        )
    return offset


# --------------------------------------------------------------------------------------------------
# Plans


def plan_layers(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    *,
    method: Method = "megatron",
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
    stage_ids: Any = None,
) -> Plan:
    """Which layers every (pp_rank, vp_stage) holds.

    Methods:
        ``"megatron"``: Megatron's even split of ``num_layers`` (+1 per ``account_for_*``) over pp then
            vpp, or uneven first/last stages with the middle divided evenly; validated as Megatron
            validates (:class:`~trainfast._util.UpstreamAssertionError` naming the lost layers).
        ``"uneven"``: any ``num_layers >= pp * vpp``: chunk ``j`` gets one layer for each layer index
            ``== j (mod pp*vpp)``, i.e. the first ``num_layers % (pp*vpp)`` chunks get one more.
        ``"paddle"``: Paddle's ``complete_chunk_id``: ``stage_ids`` (int `[num_layers]`) is the pipeline
            stage the user placed each layer on (each stage >= vpp layers); each stage's layers are
            dealt round-robin over its vpp chunks, then chunks are cut in global layer order.

    Returns:
        ``{(pp_rank, vp_stage): range(start, stop)}`` in global chunk order (vp-major); the ranges
        tile ``range(num_layers)`` exactly once, in order.
    """
    check_choice(method, "method", _METHODS)
    num_layers = _check_int(num_layers, "num_layers", min_value=0)
    pp = _check_int(pp, "pp", min_value=1)
    vpp = _optional_int(vpp, "vpp", min_value=1)
    first = _optional_int(num_layers_in_first_pipeline_stage, "num_layers_in_first_pipeline_stage")
    last = _optional_int(num_layers_in_last_pipeline_stage, "num_layers_in_last_pipeline_stage")
    account_for_embedding_in_pipeline_split = check_bool(account_for_embedding_in_pipeline_split,
                                                         "account_for_embedding_in_pipeline_split")
    account_for_loss_in_pipeline_split = check_bool(account_for_loss_in_pipeline_split,
                                                    "account_for_loss_in_pipeline_split")
    megatron_only = first is not None or last is not None or account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split
    if method != "megatron" and megatron_only:
        raise ValueError(f"num_layers_in_first/last_pipeline_stage and account_for_* need method='megatron' (got {method!r})")
    if method != "paddle" and stage_ids is not None:
        raise ValueError(f"stage_ids needs method='paddle' (got {method!r})")
    if method == "megatron":
        try:
            counts, offsets = _core.pipeline_megatron_plan(
                num_layers, pp, vpp, first, last,
                bool(account_for_embedding_in_pipeline_split), bool(account_for_loss_in_pipeline_split),
            )
        except ValueError as error:
            raise UpstreamAssertionError(str(error)) from None
    elif method == "uneven":
        counts, offsets = _core.pipeline_uneven_plan(num_layers, pp, vpp or 1)
    else:
        if stage_ids is None:
            raise ValueError("method='paddle' needs stage_ids: the pipeline stage of every layer")
        ids = as_array(stage_ids, "stage_ids", np.int64, kind="int")
        if ids.shape[0] != num_layers:
            raise ValueError(f"stage_ids must have num_layers={num_layers} entries (got {ids.shape[0]})")
        if ids.size > 1 and bool(np.any(ids[1:] < ids[:-1])):
            logger.warning("stage_ids are not non-decreasing: like Paddle, only each stage's layer count is used")
        counts, offsets = _core.pipeline_paddle_plan(ids, pp, vpp or 1)
    return _plan_dict(counts, offsets, pp)


def _plan_counts(plan: Any, pp: int, vpp: int) -> np.ndarray:
    """Per-chunk layer counts of a plan, after checking it tiles its layers exactly once in order."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict {{(pp_rank, vp_stage): range}} (got {type(plan).__name__})")
    if pp * vpp > _MAX_CHUNKS:  # before the set of every (pp_rank, vp_stage) below
        raise ValueError(f"pp times vpp must be <= 2^22 (got pp={pp}, vpp={vpp})")
    expected = {(p, v) for v in range(vpp) for p in range(pp)}
    keys = set(plan.keys())
    if keys != expected:
        missing, extra = sorted(expected - keys), sorted(keys - expected, key=repr)
        raise ValueError(
            f"plan must have exactly the keys (pp_rank, vp_stage) for pp={pp}, vpp={vpp}"
            + (f"; missing {missing[:4]}" if missing else "") + (f"; unexpected {extra[:4]}" if extra else "")
        )
    counts = np.zeros(pp * vpp, dtype=np.int64)
    next_layer = 0
    for chunk in range(pp * vpp):
        key = (chunk % pp, chunk // pp)
        layers = plan[key]
        if not isinstance(layers, range):
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
                raise TypeError(f"plan[{key}] must be a range of layer ids (got {type(layers).__name__})")
            ids = [_check_int(x, f"plan[{key}] layer id") for x in layers]
            if ids and ids != list(range(ids[0], ids[0] + len(ids))):
                raise ValueError(f"plan[{key}] must hold consecutive layer ids (got {ids[:8]})")
            layers = range(ids[0], ids[0] + len(ids)) if ids else range(0)
        elif len(layers) > 1 and layers.step != 1:
            raise ValueError(f"plan[{key}] must be a range of consecutive layer ids (got {layers!r})")
        if len(layers) and layers.start != next_layer:
            if layers.start > next_layer:
                effect = f"layers {next_layer}-{layers.start - 1} would be lost"
            else:
                effect = f"layers {layers.start}-{min(next_layer, layers.stop) - 1} would be built twice"
            raise ValueError(f"plan[{key}] starts at layer {layers.start}, not {next_layer}: {effect}")
        counts[chunk] = len(layers)
        next_layer += len(layers)
    return counts


def _check_layout_sizes(pp: int, vpp: int) -> None:
    """Megatron numbers every virtual stage's layers from 0 when pp == 1 (its layer offset is 0),
    so a layout string with several virtual stages on one pipeline rank would build layers twice."""
    if pp == 1 and vpp > 1:
        raise ValueError(
            f"a layout string needs pp > 1 when vpp > 1 (got pp=1, vpp={vpp}): with "
            "pipeline_model_parallel_size=1 Megatron numbers every virtual stage's layers from 0"
        )


def to_layout_str(plan: Any, pp: int, vpp: int | None = None) -> str:
    """The Megatron ``--pipeline-model-parallel-layout`` string of a plan (E on the first chunk, L
    on the last), e.g. ``'Ett|tt|tt|tL'``. ValueError for ``pp == 1`` with ``vpp > 1``, which Megatron
    would number as layers 0.. on every virtual stage."""
    pp = _check_int(pp, "pp", min_value=1)
    vpp = _check_int(1 if vpp is None else vpp, "vpp", min_value=1)
    _check_layout_sizes(pp, vpp)
    counts = _plan_counts(plan, pp, vpp)
    return _core.pipeline_plan_to_layout_str(counts, pp, vpp)


class BalancedLayout(tuple):
    """``(plan, layout_str)`` of :func:`balanced_layout`, with the figures as attributes.

    - ``max_chunk_cost``: the most expensive chunk (the exact minimum over all splits).
    - ``max_stage_cost``: the most expensive pipeline stage (sum of its chunks).
    - ``chunk_costs`` float64 `[pp*vpp]`, ``stage_costs`` float64 `[pp]`, ``boundaries`` int64
      `[pp*vpp+1]` (chunk ``c`` is layers ``boundaries[c]:boundaries[c+1]``), CPU tensors.
    """

    plan: Plan
    layout_str: str
    max_chunk_cost: float
    max_stage_cost: float
    chunk_costs: Any
    stage_costs: Any
    boundaries: Any

    def __new__(cls, plan: Plan, layout_str: str, **figures: Any) -> BalancedLayout:
        self = super().__new__(cls, (plan, layout_str))
        self.plan = plan
        self.layout_str = layout_str
        for name, value in figures.items():
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        return (f"BalancedLayout(layout_str={self.layout_str!r}, max_chunk_cost={self.max_chunk_cost!r}, "
                f"max_stage_cost={self.max_stage_cost!r})")


def _check_cost(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number (got {type(value).__name__})")
    try:
        as_float = float(value)
    except OverflowError:  # a Python int past float's range (its digits could pass str()'s limit)
        raise ValueError(f"{name} must be a finite non-negative number (got an int of {int(value).bit_length()} bits)") from None
    if not math.isfinite(as_float) or as_float < 0:
        raise ValueError(f"{name} must be a finite non-negative number (got {value})")
    return as_float


def _check_layer_costs(costs: np.ndarray, embedding_cost: float, loss_cost: float) -> None:
    """Each cost finite and >= 0, and their total finite (else every chunk cost could be inf)."""
    bad = np.flatnonzero(~(np.isfinite(costs) & (costs >= 0)))
    if bad.size:
        raise ValueError(f"layer_costs[{int(bad[0])}] must be a finite non-negative number (got {costs[bad[0]]})")
    with np.errstate(over="ignore"):
        total = float(np.sum(costs)) + embedding_cost + loss_cost
    if not math.isfinite(total):
        raise ValueError("layer_costs (with embedding_cost and loss_cost) must sum to a finite float64 (got inf)")


def balanced_layout(
    layer_costs: Any, pp: int, vpp: int | None = 1, *, embedding_cost: float = 0.0, loss_cost: float = 0.0
) -> BalancedLayout:
    """Cost-balanced split of the layers into ``pp * vpp`` contiguous chunks (chunk ``c`` on pipeline
    rank ``c % pp``, virtual stage ``c // pp``; every chunk >= 1 layer).

    The most expensive chunk is as cheap as possible (exact optimum); among the splits reaching it, a
    deterministic local search lowers the most expensive pipeline stage. A chunk's cost is its layer
    costs added in layer order in float64, plus ``embedding_cost`` on the chunk holding layer 0 (added
    first) and ``loss_cost`` on the chunk holding the last layer (added last).

    Args:
        layer_costs: float `[num_layers]` (tensor, array or sequence), finite and >= 0.
        pp, vpp: pipeline and virtual pipeline sizes (``vpp`` None: 1, as in :func:`plan_layers`);
            ``num_layers >= pp * vpp``; ``pp > 1`` when ``vpp > 1`` (Megatron's layer numbering).

    Returns:
        :class:`BalancedLayout`, unpackable as ``plan, layout_str``; pass ``layout_str`` to Megatron's
        ``--pipeline-model-parallel-layout``.
    """
    pp = _check_int(pp, "pp", min_value=1)
    vpp = 1 if vpp is None else _check_int(vpp, "vpp", min_value=1)
    _check_layout_sizes(pp, vpp)
    costs = as_array(layer_costs, "layer_costs", np.float64, kind="float")
    embedding_cost = _check_cost(embedding_cost, "embedding_cost")
    loss_cost = _check_cost(loss_cost, "loss_cost")
    _check_layer_costs(costs, embedding_cost, loss_cost)
    bounds, chunk_cost_arr, stage_cost_arr, max_chunk, max_stage = _core.pipeline_balanced_split(
        costs, pp, vpp, embedding_cost, loss_cost
    )
    counts = np.diff(bounds)
    plan = _plan_dict(counts, bounds[:-1], pp)
    layout_str = _core.pipeline_plan_to_layout_str(np.ascontiguousarray(counts), pp, vpp)
    return BalancedLayout(
        plan, layout_str, max_chunk_cost=float(max_chunk), max_stage_cost=float(max_stage),
        chunk_costs=to_tensor(chunk_cost_arr), stage_costs=to_tensor(stage_cost_arr), boundaries=to_tensor(bounds),
    )


def chunk_costs(plan: Any, layer_costs: Any, pp: int, vpp: int | None = None, *, embedding_cost: float = 0.0,
                loss_cost: float = 0.0) -> tuple[list[float], list[float]]:
    """(per-chunk costs in global order, per-stage costs) of any plan: layer costs added in order in
    float64, ``embedding_cost`` first on chunk (0, 0), ``loss_cost`` last on the last chunk (as
    :func:`balanced_layout`, whose chunks are never empty).

    Args:
        plan: ``{(pp_rank, vp_stage): range of layers}``, as :func:`plan_layers` returns.
        layer_costs: float `[num_layers]` (tensor, array or sequence), finite and >= 0.
        pp, vpp: the plan's pipeline and virtual pipeline sizes.

    Returns:
        ``[pp * vpp]`` chunk costs (chunk ``vp_stage * pp + pp_rank``) and ``[pp]`` stage costs.

    >>> plan = plan_layers(8, 2, 2)
    >>> chunk_costs(plan, [1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 3.0], 2, 2, embedding_cost=0.5, loss_cost=0.5)
    ([2.5, 3.0, 2.0, 4.5], [4.5, 7.5])
    """
    pp = _check_int(pp, "pp", min_value=1)
    vpp = _check_int(1 if vpp is None else vpp, "vpp", min_value=1)
    counts = _plan_counts(plan, pp, vpp)
    cost_arr = as_array(layer_costs, "layer_costs", np.float64, kind="float")
    if int(counts.sum()) != cost_arr.shape[0]:
        raise ValueError(f"the plan has {int(counts.sum())} layers but layer_costs has {cost_arr.shape[0]}")
    embedding_cost = _check_cost(embedding_cost, "embedding_cost")
    loss_cost = _check_cost(loss_cost, "loss_cost")
    _check_layer_costs(cost_arr, embedding_cost, loss_cost)
    costs = cost_arr.tolist()
    per_chunk, start = [], 0
    for chunk, count in enumerate(counts.tolist()):
        total = embedding_cost if chunk == 0 else 0.0
        for cost in costs[start:start + count]:
            total += cost
        if chunk == len(counts) - 1:
            total += loss_cost
        per_chunk.append(total)
        start += count
    per_stage = []
    for stage in range(pp):
        total = 0.0
        for chunk in range(stage, pp * vpp, pp):
            total += per_chunk[chunk]
        per_stage.append(total)
    return per_chunk, per_stage
