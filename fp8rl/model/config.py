"""Model hyper-parameters: one frozen dataclass, read from and written to a
Hugging Face `config.json`.

One decoder covers Llama 3 (with llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and SmolLM2. The fields below are everything the
forward pass depends on; `from_hf_dict` rejects architectures it cannot run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    extra: dict[str, Any] = field(default_factory=dict)  # unused HF keys, kept for export

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in (
            "llama3",
            "default",
        ):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r} (supported: llama3)")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers `config.json` dict (Llama, Qwen2, Qwen3)."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }.get(d.get("model_type", ""), str(d.get("model_type")))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch != "Qwen2ForCausalLM" and (d.get("attention_bias") or d.get("mlp_bias")):
            # In HF Llama/Qwen3 attention_bias also puts a bias on o_proj (and mlp_bias on the
            # MLP), which the decoder does not have: refuse rather than drop weights.
            raise ValueError(f"{arch} with attention_bias/mlp_bias=true is not supported")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # transformers >= 5 moves theta and scaling into `rope_parameters`.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None and "rope_type" not in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type")}
        known = {
            "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "tie_word_embeddings", "attention_bias",
            "bos_token_id", "eos_token_id",
        }
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            architecture=arch,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (no flag in its config); others are refused above.
            attention_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` dict for this model."""
        model_type = {
            "LlamaForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
        }[self.architecture]
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
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
