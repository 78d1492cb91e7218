"""ModelConfig: the model's shape, numerics and family switches, read once from a HuggingFace config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from jaxmodel.errors import UserError
from jaxmodel.families import FAMILIES, Family
from jaxmodel.families.family import SUPPORTED_ACTIVATIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError, UserError):
    """A config.json that is not a config of a family we can run; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `factor` divides every frequency when `type == "linear"`; `low_freq_factor` and
    `high_freq_factor` are `llama3`'s, `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`, `attention_factor`
    (None: from `factor` and the mscales) and `truncate` YaRN's (`yarn`), which also scales cos and sin
    (`attention_scaling`); `factor` and `original_max_position_embeddings` are both's."""

    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor (transformers' `_compute_yarn_parameters`),
        1 for the other types."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def to_hf(self) -> dict[str, Any]:
        """As transformers 5 spells one `rope_parameters`."""
        params: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type == "linear":
            params["factor"] = self.factor
        if self.type == "llama3":
            params.update(factor=self.factor, low_freq_factor=self.low_freq_factor,
                          high_freq_factor=self.high_freq_factor,
                          original_max_position_embeddings=self.original_max_position_embeddings)
        if self.type == "yarn":
            params.update(factor=self.factor, original_max_position_embeddings=self.original_max_position_embeddings,
                          beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                          **({"mscale": self.mscale} if self.mscale else {}),
                          **({"mscale_all_dim": self.mscale_all_dim} if self.mscale_all_dim else {}),
                          **({} if self.attention_factor is None else {"attention_factor": self.attention_factor}))
        return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `scale` times longer: `0.1 mscale ln(scale) + 1` (1 at most)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and its switches. `model_type` names the family (`jaxmodel.families`), which sets the
    switches from its config.json: biases (`qkv_bias` on q, k and v, `o_bias` on o, `mlp_bias`), `qk_norm` (an
    RMSNorm over head_dim on each query and key head before RoPE) and sliding-window attention (`sliding_window`
    keys, on the layers `sliding_layers` marks; none when `sliding_layers` is empty), `local_rope` (the RoPE of
    the windowed layers, when not `rope`), `hidden_act` (the MLP gate's activation), `norm_unit_offset` (every
    RMSNorm scales by `1 + weight`), `sandwich_norms` (attention's and the MLP's outputs normed too, before the
    residual add), `scale_embeddings` (the input embeddings times sqrt(hidden_size); the tied head is not) and
    `query_pre_attn_scalar` (attention scores scaled by its inverse square root instead of head_dim's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    local_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Mixture of experts (jaxmodel.moe), none when num_experts is 0: each token's num_experts_per_tok of
    # num_experts experts of moe_intermediate_size, their router weights renormalised over the k when
    # norm_topk_prob and rounded to the compute dtype before weighting the experts' outputs when
    # round_router_weights (Qwen3-MoE; Mixtral keeps them float32). sparse_layers marks the layers whose MLP is
    # the experts (one flag per layer; empty: none); the others have the dense MLP of intermediate_size.
    # router_aux_loss_coef weighs the load-balancing loss a run training the routers adds (jaxmodel.moe).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    round_router_weights: bool = False
    sparse_layers: tuple[bool, ...] = ()
    router_aux_loss_coef: float = 0.0
    # DeepSeek-V3's routing when router_groups > 0 (jaxmodel.moe.grouped_sigmoid_route): sigmoid scores with a
    # selection bias, the experts in router_groups groups of which router_top_groups are kept, the weights times
    # routed_scaling_factor; shared_experts always-on experts beside the routed ones (one MLP of
    # moe_intermediate_size * shared_experts).
    router_groups: int = 0
    router_top_groups: int = 0
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0
    # Multi-head latent attention (jaxmodel.model.LatentAttention; DeepSeek-V3) when kv_lora_rank > 0: queries
    # through a q_lora_rank-wide bottleneck (0: one q_proj), each head's keys and values from one kv_lora_rank-wide
    # latent, plus a rotary key part shared by the heads; queries and keys qk_nope_head_dim + head_dim wide (head_dim
    # is the rotary part's width, as transformers' config says), values v_head_dim; rope_interleave: the rotary
    # dimensions in interleaved pairs (x0, x1), (x2, x3), ...
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Layers a checkpoint holds past num_hidden_layers, not part of the model (DeepSeek-V3's multi-token prediction,
    # num_nextn_predict_layers; transformers does not load them either): the converter skips their tensors.
    prediction_layers: int = 0

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r}; supported: {', '.join(FAMILIES)}")
        if self.sliding_layers and (len(self.sliding_layers) != self.num_hidden_layers or not self.sliding_window):
            raise ConfigError(f"sliding_layers needs one flag per layer ({self.num_hidden_layers}) and a "
                              f"positive sliding_window, got {len(self.sliding_layers)} and {self.sliding_window}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                              f"num_experts={self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} must be a positive integer")
        if self.sparse_layers and (len(self.sparse_layers) != self.num_hidden_layers or not self.num_experts):
            raise ConfigError(f"sparse_layers needs one flag per layer ({self.num_hidden_layers}) and experts, got "
                              f"{len(self.sparse_layers)} flags and num_experts={self.num_experts}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act={self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.router_groups and (self.num_experts % self.router_groups or self.num_experts // self.router_groups < 2
                                   or not 0 < self.router_top_groups <= self.router_groups
                                   or self.num_experts_per_tok > self.router_top_groups * self.num_experts //
                                   self.router_groups):
            raise ConfigError(f"n_group={self.router_groups} must split the {self.num_experts} experts into groups of "
                              f"2 or more, of which topk_group={self.router_top_groups} (1 to n_group) hold at least "
                              f"num_experts_per_tok={self.num_experts_per_tok}")
        if self.kv_lora_rank and self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"num_key_value_heads={self.num_key_value_heads}: latent attention gives every one of "
                              f"the {self.num_attention_heads} heads its own keys and values")

    @property
    def qk_head_dim(self) -> int:
        """The width of a query's and a key's head: the rotary part and, with latent attention, the rest."""
        return self.head_dim + self.qk_nope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def attention_width(self) -> int:
        """The one head width attention and the KV cache take: with latent attention the wider of the queries' and
        the values' (the other zero-padded), else head_dim."""
        return max(self.qk_head_dim, self.v_head_dim) if self.kv_lora_rank else self.head_dim

    @property
    def attention_scale(self) -> float:
        """The factor of every attention score `q . k`: the query width's inverse square root (or
        `query_pre_attn_scalar`'s), with latent attention and YaRN times `yarn_mscale(factor, mscale_all_dim)`
        squared (transformers' DeepSeek-V3 attention)."""
        scale = (self.query_pre_attn_scalar or self.qk_head_dim) ** -0.5
        if self.kv_lora_rank and self.rope.type == "yarn" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in keys (a query sees itself and the `window - 1` keys before it), 0 for
        full causal attention."""
        if not self.sliding_layers:
            return (0,) * self.num_hidden_layers
        return tuple(self.sliding_window if s else 0 for s in self.sliding_layers)

    def layer_runs(self) -> tuple[tuple[bool, int, int], ...]:
        """The layers as runs of consecutive layers of one kind: (sparse, first layer, count) in model order."""
        runs: list[tuple[bool, int, int]] = []
        for i in range(self.num_hidden_layers):
            sparse = bool(self.sparse_layers) and self.sparse_layers[i]
            if runs and runs[-1][0] == sparse:
                runs[-1] = (sparse, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((sparse, i, 1))
        return tuple(runs)

    def stack_layers(self, sparse: bool) -> tuple[int, ...]:
        """The layers of one kind, in order: slice `j` of that kind's stacked parameters is layer `[j]`."""
        flags = self.sparse_layers or (False,) * self.num_hidden_layers
        return tuple(i for i, s in enumerate(flags) if s == sparse)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "ModelConfig":
        """Read a HF config of a supported family: a dict, a config.json path, or a directory holding config.json.

        Accepts both dialects: legacy `rope_theta` + `rope_scaling`, and transformers 5 `rope_parameters`.
        """
        if isinstance(source, Mapping):
            return _parse(dict(source), where="config")
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found (expected a HuggingFace config.json)") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return _parse(raw, where=str(path))

    def to_hf(self) -> dict[str, Any]:
        """The config as a transformers 5 `config.json` dict of its family (for tiny test models and merged exports)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        architecture = {"architectures": [self.family.architecture], "model_type": self.model_type}
        decoder = {
            **architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            **self.family.write(self),
        }
        if self.family.text_config is None:
            return decoder
        # a multimodal class: the decoder under its text_config (transformers fills in the rest with its defaults)
        text = {k: v for k, v in decoder.items() if k != "architectures"}
        return {**architecture, "tie_word_embeddings": self.tie_word_embeddings,
                self.family.text_config: {**text, "model_type": self.family.text_model_type}}


class Fields:
    """config.json's fields, read with their types checked; errors name the file (`where`) and the field."""

    def __init__(self, raw: dict[str, Any], where: str):
        self.raw, self.where = raw, where

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = dataclasses.MISSING) -> Any:
        if name not in self.raw or self.raw[name] is None:
            if default is dataclasses.MISSING:
                raise self.error(f"field '{name}' is missing")
            return default
        value = self.raw[name]
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _as_tuple(kind))
        if not ok:
            names = " or ".join(k.__name__ for k in _as_tuple(kind))
            raise self.error(f"field '{name}' must be {names}, got {value!r}")
        return value

    def rope(self, params: dict[str, Any], field: str) -> RopeConfig:
        """One RoPE's parameters (`rope_type`, `rope_theta`, its type's fields), `field` naming them in errors."""
        return _rope(params, self.where, field)

    def positive(self, name: str, default: Any = dataclasses.MISSING) -> int:
        value = self.get(name, int, default)
        if value <= 0:
            raise self.error(f"field '{name}' must be a positive integer, got {value!r}")
        return value


# Fields a multimodal config keeps outside its text_config, which its decoder takes when text_config has none.
OUTER_FIELDS = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def _parse(raw: dict[str, Any], where: str) -> ModelConfig:
    fields = Fields(raw, where)
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise fields.error(f"field 'model_type' is {model_type!r}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    if family.text_config is not None:  # a multimodal config: its decoder is described under text_config
        text = fields.get(family.text_config, dict, {})
        raw = {**{k: raw[k] for k in OUTER_FIELDS if k in raw}, **text, "model_type": model_type}
        where = f"{where}: {family.text_config}"
    raw = {**dict(family.defaults), **raw}
    fields = Fields(raw, where)
    act = raw.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise fields.error(f"field 'hidden_act' is {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")

    hidden = fields.positive("hidden_size")
    heads = fields.positive("num_attention_heads")
    kv_heads = fields.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise fields.error(f"field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
    if hidden % heads and raw.get("head_dim") is None:
        raise fields.error("field 'head_dim' is missing and hidden_size is not a multiple of heads")
    head_dim = fields.positive("head_dim", hidden // heads)
    eos = fields.get("eos_token_id", (int, list), None)
    values = dict(
        vocab_size=fields.positive("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.positive("intermediate_size"),
        num_hidden_layers=fields.positive("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=fields.positive("max_position_embeddings", 2048),
        rms_norm_eps=float(fields.get("rms_norm_eps", (int, float), 1e-6)),
        rope=_parse_rope(raw, where),
        tie_word_embeddings=fields.get("tie_word_embeddings", bool, False),
        model_type=model_type,
        bos_token_id=fields.get("bos_token_id", int, None),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=fields.get("pad_token_id", int, None),
        hidden_act=act,
    )
    return ModelConfig(**{**values, **family.read(fields)})


def _parse_rope(raw: dict[str, Any], where: str) -> RopeConfig:
    """Both dialects: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (legacy)."""
    if isinstance(raw.get("rope_parameters"), dict):
        params, field_name = dict(raw["rope_parameters"]), "rope_parameters"
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if "original_max_position_embeddings" in raw:  # transformers prefers the top-level field
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    else:
        field_name = "rope_scaling"
        params = dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    if params.get("rope_type", params.get("type")) == "yarn":
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    return _rope(params, where, field_name)


def _rope(params: dict[str, Any], where: str, field_name: str) -> RopeConfig:
    if not isinstance(params.get("rope_theta"), (int, float)) or params["rope_theta"] <= 0:
        raise ConfigError(f"{where}: field 'rope_theta' must be a positive number, got {params.get('rope_theta')!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{where}: field '{field_name}.rope_type' is {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return RopeConfig(type="default", theta=theta)
    def number(key, default=None, positive=True):
        return _rope_number(params, key, f"{where}: field '{field_name}.{key}'", default, positive)

    if rope_type == "linear":
        return RopeConfig(type="linear", theta=theta, factor=number("factor"))
    if rope_type == "yarn":  # as transformers reads it: beta_fast/beta_slow absent or 0 are 32 and 1
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{where}: field '{field_name}.truncate' must be true or false, got {truncate!r}")
        return RopeConfig(type="yarn", theta=theta, factor=number("factor"),
                          original_max_position_embeddings=int(number("original_max_position_embeddings")),
                          beta_fast=number("beta_fast", 0.0, positive=False) or 32.0,
                          beta_slow=number("beta_slow", 0.0, positive=False) or 1.0,
                          mscale=number("mscale", 0.0, positive=False),
                          mscale_all_dim=number("mscale_all_dim", 0.0, positive=False),
                          attention_factor=None if params.get("attention_factor") is None else
                          number("attention_factor"), truncate=truncate)
    values = {key: number(key) for key in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")}
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(f"{where}: field '{field_name}.high_freq_factor' must exceed low_freq_factor")
    return RopeConfig(type="llama3", theta=theta, factor=values["factor"], low_freq_factor=values["low_freq_factor"],
                      high_freq_factor=values["high_freq_factor"],
                      original_max_position_embeddings=int(values["original_max_position_embeddings"]))


def _rope_number(params: dict[str, Any], key: str, field: str, default: float | None = None,
                 positive: bool = True) -> float:
    """`params[key]` as a float, a finite positive (or, not `positive`, non-negative) number; `default` when absent
    (None: required). `field` names it in the error."""
    value = params.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or \
            (value <= 0 if positive else value < 0):
        raise ConfigError(f"{field} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
    return float(value)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
