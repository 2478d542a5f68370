"""Model hyper-parameters: one frozen dataclass, read from and written to a
Hugging Face `config.json`.

One decoder covers Llama 3 (with llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and SmolLM2, and their mixture-of-experts forms:
Qwen3-MoE, Qwen2-MoE (with its gated shared expert) and Mixtral. The fields
below are everything the forward pass depends on; `from_hf_dict` rejects
architectures it cannot run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
# config.json `model_type` of each architecture (what an old config without `architectures` names)
MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Mixture of experts (0 experts: a dense model). Each MoE layer routes a token
    # to its `num_experts_per_tok` most probable experts (softmax over all experts,
    # then top-k; `norm_topk_prob`: the k weights renormalised to sum to 1, as
    # Mixtral always does). Layer i is MoE unless i is in `mlp_only_layers` or
    # (i + 1) is not a multiple of `decoder_sparse_step` (Qwen's convention); other
    # layers have a dense MLP of `intermediate_size`. Qwen2-MoE adds a shared
    # expert of `shared_expert_intermediate_size`, gated by sigmoid(x . w).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # unused HF keys, kept for export

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_size(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} is odd; rotary embeddings need an even head_dim")
        _check_positive("rms_norm_eps", self.rms_norm_eps)
        _check_positive("rope_theta", self.rope_theta)
        self._check_moe()
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        for name in ("bos_token_id", "eos_token_id"):
            ids = getattr(self, name)
            if not (ids is None or _is_int(ids) or (isinstance(ids, list) and all(_is_int(i) for i in ids))):
                raise ValueError(f"{name} must be an integer token id (or a list of them), got {ids!r}")

    def _check_moe(self) -> None:
        layers = self.mlp_only_layers
        if not (isinstance(layers, (list, tuple)) and all(_is_int(i) for i in layers)):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(layers))  # lists from JSON become tuples
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts:
                raise ValueError(f"{self.architecture} has no experts; num_experts must be 0, got {self.num_experts}")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            _check_size(name, getattr(self, name))
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} is more than num_experts={self.num_experts}"
            )
        if self.architecture == "MixtralForCausalLM" and not (
            self.norm_topk_prob and self.decoder_sparse_step == 1 and not self.mlp_only_layers
        ):
            # config.json has no keys for these: another value could not be written back.
            raise ValueError(
                "MixtralForCausalLM has experts in every layer and renormalised top-k weights: it needs "
                f"norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=() (got {self.norm_topk_prob}, "
                f"{self.decoder_sparse_step}, {self.mlp_only_layers})"
            )
        if self.architecture == "Qwen2MoeForCausalLM":
            _check_size("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        elif self.shared_expert_intermediate_size:
            raise ValueError(f"{self.architecture} has no shared expert; shared_expert_intermediate_size must be 0")

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer `layer` has experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers with experts, in order."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers `config.json` dict (Llama, Qwen2, Qwen3 and the MoE forms)."""
        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"architectures must be a list of class names, got {archs!r}")
        by_type = {t: a for a, t in MODEL_TYPES.items()}
        arch = archs[0] if archs else by_type.get(d.get("model_type", ""), str(d.get("model_type")))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and (d.get("attention_bias") or d.get("mlp_bias")):
            # In HF Llama/Qwen3 attention_bias also puts a bias on o_proj (and mlp_bias on the
            # MLP), which the decoder does not have: refuse rather than drop weights.
            raise ValueError(f"{arch} with attention_bias/mlp_bias=true is not supported")
        # The HF names, checked here so that an error names the key as config.json spells it.
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            _check_size(key, d[key])
        num_heads, hidden = d["num_attention_heads"], d["hidden_size"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % num_heads != 0:
                raise ValueError(
                    f"hidden_size={hidden} is not a multiple of num_attention_heads={num_heads} "
                    "(and there is no head_dim)"
                )
            head_dim = hidden // num_heads
        rope_scaling = d.get("rope_scaling")
        if not (rope_scaling is None or isinstance(rope_scaling, dict)):
            raise ValueError(f"rope_scaling must be an object or null, got {rope_scaling!r}")
        rope_theta = d.get("rope_theta")
        # transformers >= 5 moves theta and scaling into `rope_parameters`.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        rope_theta = 10000.0 if rope_theta is None else rope_theta
        _check_positive("rope_theta", rope_theta)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None and "rope_type" not in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type")}
        known = {
            "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias",
            "bos_token_id", "eos_token_id", *(_MOE_KEYS if arch in MOE_ARCHITECTURES else ()),
        }
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if d.get("num_key_value_heads") is None else d["num_key_value_heads"],
            head_dim=head_dim,
            architecture=arch,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (no flag in its config; Qwen2-MoE's
            # transformers 5 config may say `qkv_bias`); others are refused above.
            attention_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and d.get("qkv_bias", True)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            **_moe_fields(arch, d),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` dict for this model."""
        model_type = MODEL_TYPES[self.architecture]
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[self.architecture],
            model_type=model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            hidden_act="silu",
            torch_dtype="float32",
        )
        if self.architecture == "LlamaForCausalLM":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.architecture == "MixtralForCausalLM":
            # Mixtral's experts are `intermediate_size` wide; it has no other MoE keys.
            d.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     intermediate_size=self.moe_intermediate_size)
        elif self.architecture in MOE_ARCHITECTURES:
            d.update(
                num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
            )
            if self.architecture == "Qwen2MoeForCausalLM":
                d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                         qkv_bias=self.attention_bias)
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------- helpers
# config.json keys read by `_moe_fields` (everything else unknown is kept in `extra`).
_MOE_KEYS = (
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias",
)


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a config.json dict (none for a dense architecture).

    Qwen3-MoE spells the expert count `num_experts` on the Hub and
    `num_local_experts` when transformers 5 writes it; Mixtral always routes to
    renormalised top-k weights through experts of `intermediate_size`. Router
    jitter and auxiliary load-balancing losses are training-time regularisers
    of pre-training: not applied (the router runs as at inference)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    if arch == "MixtralForCausalLM":
        if d.get("sliding_window") is not None:
            raise ValueError(
                f"MixtralForCausalLM with sliding_window={d['sliding_window']!r} is not supported "
                "(the decoder attends over the whole context); set it to null"
            )
        return {
            "num_experts": d["num_local_experts"],
            "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True,
        }
    if d.get("use_sliding_window"):
        raise ValueError(f"{arch} with use_sliding_window=true is not supported (the decoder attends over the whole context)")
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    out = {
        "num_experts": experts,
        "num_experts_per_tok": d["num_experts_per_tok"],
        "moe_intermediate_size": d["moe_intermediate_size"],
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "decoder_sparse_step": d.get("decoder_sparse_step", 1),
        "mlp_only_layers": d.get("mlp_only_layers") or (),
    }
    if arch == "Qwen2MoeForCausalLM":
        out["shared_expert_intermediate_size"] = d["shared_expert_intermediate_size"]
    return out


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file (config.json, tokenizer_config.json, ...); every way it
    can be unreadable is a one-line ValueError that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file (byte {e.start}); is it corrupt?") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a size


def _check_size(name: str, value: Any) -> None:
    """A dimension or count: an integer in [1, 2**31) (larger ones are corrupt files, not models)."""
    if not _is_int(value) or not 0 < value < 2**31:
        raise ValueError(f"{name} must be a positive integer below 2**31, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_rope_scaling(rs: Any) -> None:
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {rs!r}")
    if rs.get("rope_type", "default") not in ("llama3", "default"):
        raise ValueError(f"unsupported rope_scaling {rs!r} (supported: llama3)")
    if rs.get("rope_type") == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rs:
                raise ValueError(f"llama3 rope_scaling has no {key!r}")
            _check_positive(f"rope_scaling.{key}", rs[key])
        if rs["high_freq_factor"] <= rs["low_freq_factor"]:
            raise ValueError(
                f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got {rs['high_freq_factor']} "
                f"and {rs['low_freq_factor']}"
            )
