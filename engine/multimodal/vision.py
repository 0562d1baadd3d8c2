"""LLaVA's image side: a CLIP or SigLIP vision tower and the MLP projector, loaded from a local checkpoint.

Every op follows transformers' modeling_clip / modeling_siglip / modeling_llava in order and dtype, so fp32 features
match LlavaForConditionalGeneration.get_image_features. Module names mirror transformers' so checkpoint tensors map
one to one. Only the layers the selected features need are built: the rest would be computed and thrown away.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from torch import nn

from engine.config import LLAVA_TEXT_PREFIX, MULTIMODAL_ARCHITECTURES, load_spec, read_safetensors_headers, run_dtype

# vision_config.model_type -> our tower kind
VISION_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
SELECT_STRATEGIES = ("default", "full")

# transformers' ACT2FN entries these towers and projectors use, written out op for op.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
    "silu": F.silu,
    "relu": F.relu,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VisionSpec:
    tower: str  # "clip" | "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    # Indices into the tower's num_layers + 1 hidden states (0: the encoder's input), made non-negative.
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default" drops the first token of each selected state (CLIP's CLS), "full" keeps all
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    # SigLIP whose config asks hidden_states[-1] to be the post-layernormed output (transformers'
    # tie_last_hidden_states); CLIP's last hidden state has no norm after it either way.
    norm_last_hidden_state: bool
    weight_prefix: str  # "vision_tower." (what transformers 5 writes) or "vision_tower.vision_model." (4.x, the Hub)
    checkpoint_dtype: str
    fingerprint: str  # the whole checkpoint's, the same as its text ModelSpec's

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r}; expected one of "
                             f"{', '.join(SELECT_STRATEGIES)}")
        for act in (self.hidden_act, self.projector_act):
            if act not in _ACTIVATIONS:
                raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Embeddings per image: every position of the tower (patches, + CLS for CLIP), less one under "default"."""
        positions = self.num_patches + (self.tower == "clip")
        return positions - (self.select_strategy == "default")

    @property
    def layers_used(self) -> int:
        return max(self.feature_layers)


def load_vision_spec(model_dir) -> VisionSpec | None:
    """The vision side of a LLaVA checkpoint; None for a text-only checkpoint. Refuses other vision towers by name."""
    model_dir = pathlib.Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    text = load_spec(model_dir)  # validates the text part, and gives the fingerprint
    if (raw.get("architectures") or [None])[0] not in MULTIMODAL_ARCHITECTURES:
        return None
    vision = raw.get("vision_config") or {}
    model_type = vision.get("model_type", "clip_vision_model")  # LlavaConfig's default tower
    if model_type not in VISION_TOWERS:
        raise ValueError(f"unsupported vision tower {model_type!r} (vision_config.model_type); supported: "
                         f"{', '.join(VISION_TOWERS)}")
    config = transformers.AutoConfig.from_pretrained(model_dir)  # folds in each tower's defaults, as transformers does
    tower = VISION_TOWERS[model_type]
    vc = config.vision_config
    return VisionSpec(
        tower=tower,
        hidden_size=vc.hidden_size,
        intermediate_size=vc.intermediate_size,
        num_layers=vc.num_hidden_layers,
        num_heads=vc.num_attention_heads,
        num_channels=vc.num_channels,
        image_size=vc.image_size,
        patch_size=vc.patch_size,
        layer_norm_eps=float(vc.layer_norm_eps),
        hidden_act=vc.hidden_act,
        feature_layers=_feature_layers(config.vision_feature_layer, vc.num_hidden_layers),
        select_strategy=config.vision_feature_select_strategy,
        projector_act=config.projector_hidden_act,
        projector_bias=bool(config.multimodal_projector_bias),
        text_hidden_size=text.hidden_size,
        image_token_id=config.image_token_index,
        norm_last_hidden_state=tower == "siglip" and bool(getattr(vc, "tie_last_hidden_states", False)),
        weight_prefix=_vision_prefix(read_safetensors_headers(model_dir)),
        checkpoint_dtype=text.checkpoint_dtype,
        fingerprint=text.fingerprint,
    )


def _feature_layers(layer: int | list[int], num_layers: int) -> tuple[int, ...]:
    """vision_feature_layer (an int or a list, negative counting from the end) -> indices into the hidden states."""
    count = num_layers + 1  # the encoder's input, then each layer's output
    layers = [layer] if isinstance(layer, int) else list(layer)
    if not layers or any(not -count <= i < count for i in layers):
        raise ValueError(f"vision_feature_layer {layer!r} is out of range for a tower of {num_layers} layers "
                         f"({count} hidden states)")
    return tuple(i % count for i in layers)


def _vision_prefix(headers: dict) -> str:
    legacy = "vision_tower.vision_model."
    return legacy if any(name.startswith(legacy) for name in headers) else "vision_tower."


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.hidden_size // spec.num_heads
        self.k_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.v_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q = self.q_proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # (N, heads, T, head_dim)
        k = self.k_proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # (N, heads, T, head_dim)
        v = self.v_proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)  # (N, heads, T, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # bidirectional: no mask
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patches (+ CLIP's class token) plus learned positions."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        clip = spec.tower == "clip"
        if clip:
            self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, spec.hidden_size, spec.patch_size, stride=spec.patch_size, bias=not clip)
        self.position_embedding = nn.Embedding(spec.num_patches + clip, spec.hidden_size)
        self.image_size = spec.image_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values (N, C, H, W) -> (N, positions, hidden)."""
        n, _, height, width = pixel_values.shape
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"image of {height}x{width} pixels; the vision tower takes {self.image_size}x"
                             f"{self.image_size} (the checkpoint's processor resizes to that)")
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # (N, patches, hidden)
        if hasattr(self, "class_embedding"):
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)  # (N, 1 + patches, hidden)
        return x + self.position_embedding.weight  # positions 0..P-1, broadcast over the batch


class VisionTower(nn.Module):
    """CLIPVisionModel / SiglipVisionModel up to the last layer the features read."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.embeddings = VisionEmbeddings(spec)
        if spec.tower == "clip":
            self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)  # sic: transformers' name
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(spec) for _ in range(spec.layers_used))
        if self._post_norm_read:
            self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    @property
    def _post_norm_read(self) -> bool:
        return self.spec.norm_last_hidden_state and self.spec.num_layers in self.spec.feature_layers

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values (N, C, H, W) -> the selected hidden states, each (N, positions, hidden), in config order."""
        x = self.embeddings(pixel_values)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        states = [x]  # hidden state i is the input of layer i
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        if self._post_norm_read:
            states[-1] = self.post_layernorm(states[-1])
        return [states[i] for i in self.spec.feature_layers]


class MultiModalProjector(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        width = spec.hidden_size * len(spec.feature_layers)  # the selected states are concatenated
        self.linear_1 = nn.Linear(width, spec.text_hidden_size, bias=spec.projector_bias)
        self.act = _ACTIVATIONS[spec.projector_act]
        self.linear_2 = nn.Linear(spec.text_hidden_size, spec.text_hidden_size, bias=spec.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionEncoder(nn.Module):
    """Vision tower + projector: pixel_values -> one embedding per image token, in the text model's width.

    Construct with from_pretrained; the caller runs forward under torch.inference_mode."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.vision_tower = VisionTower(spec)
        self.multi_modal_projector = MultiModalProjector(spec)

    @classmethod
    def from_pretrained(cls, model_dir, dtype: str | None = None, device="cpu") -> VisionEncoder:
        spec = load_vision_spec(model_dir)
        if spec is None:
            raise ValueError(f"{model_dir}: a text-only checkpoint has no vision tower")
        dtype = run_dtype(dtype, spec.checkpoint_dtype, device)
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
        with torch.device("meta"):  # no memory and no random init for weights about to be overwritten
            model = cls(spec)
        model = model.to(_DTYPES[dtype]).to_empty(device=device)
        _load_weights(model, model_dir)
        return model.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values (N, C, H, W) -> image embeddings (N, tokens_per_image, text_hidden)."""
        states = self.vision_tower(pixel_values)
        if self.spec.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # transformers drops the first position, CLS or (SigLIP) a patch
        return self.multi_modal_projector(torch.cat(states, dim=-1))  # (N, tokens, text_hidden)


def _load_weights(model: VisionEncoder, model_dir) -> None:
    """Fills every parameter from the checkpoint; ValueError naming missing, mis-shaped or unexpected tensors."""
    headers = read_safetensors_headers(model_dir)
    targets = {_checkpoint_name(name, model.spec): p for name, p in model.named_parameters()}
    missing = sorted(set(targets) - set(headers))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks vision tensor(s) {', '.join(missing)}")
    spec = model.spec
    unexpected = sorted(n for n in _vision_names(headers) if n not in targets and not _unread(n, spec))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected vision tensor(s) in checkpoint: {', '.join(unexpected)}")
    by_file = defaultdict(list)
    for name, param in targets.items():
        if tuple(headers[name]["shape"]) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(headers[name]['shape'])}, model expects "
                             f"{tuple(param.shape)}")
        by_file[headers[name]["file"]].append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(name))  # copy_ casts to the model dtype


def _checkpoint_name(ours: str, spec: VisionSpec) -> str:
    if ours.startswith("vision_tower."):
        return spec.weight_prefix + ours.removeprefix("vision_tower.")
    return ours  # multi_modal_projector.* as on disk


def _vision_names(headers: dict) -> list[str]:
    """Every tensor not the text model's (engine/model/loader.py checks those): tower, projector, or nobody's."""
    return [n for n in headers if not n.startswith(LLAVA_TEXT_PREFIX)]


def _unread(name: str, spec: VisionSpec) -> bool:
    """Tensors of the tower the features never read: layers past the last selected one, the post-norm, SigLIP's
    pooling head."""
    if not name.startswith(spec.weight_prefix):
        return False
    rest = name.removeprefix(spec.weight_prefix)
    if rest.startswith(("post_layernorm.", "head.")):
        return True
    parts = rest.split(".")
    if rest.startswith("encoder.layers.") and parts[2].isdigit():
        return spec.layers_used <= int(parts[2]) < spec.num_layers
    return False
