"""A zoo of third-party models, built from small configs with random weights.

Each entry returns (model, example_inputs, example_kwargs) for a batch of 4 (two micro-batches of
two), small enough to compile in seconds on a CPU. Nothing is downloaded: every model comes from
a constructor or a config, with dropout and drop-path set to zero so that a pipeline of it can be
compared exactly with the plain model. Parameters that the library initialises to zero are then
filled with small seeded values (`fill_zero_parameters`), so that no check compares zeros with
zeros. A library that is not installed leaves its entries out
(`available()`); importing this file needs only torch.

    for entry in available():
        model, args, kwargs = entry.build()
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["BATCH", "ZOO", "ZooEntry", "available", "fill_zero_parameters", "get"]

BATCH = 4

Built = tuple[nn.Module, tuple, dict]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    library: str  # the package it needs: torch, torchvision, timm, ...
    category: str
    build: Callable[[], Built]

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.library) is not None


ZOO: list[ZooEntry] = []


def fill_zero_parameters(model: nn.Module, std: float = 0.02, seed: int = 0) -> list[str]:
    """Give every floating-point weight that is entirely zero small seeded random values;
    returns the names of those filled.

    Libraries zero some weights on purpose so that a fresh block starts as the identity or a
    fresh head outputs nothing: final projections and classifier heads (torchvision's ViT head,
    timm's MLP-Mixer head, DiT's proj_out, ControlNet's zero convs), adaLN-zero modulation,
    layer-scale gammas and the last BatchNorm gamma of a residual branch, relative-position bias
    tables, biases, class tokens. A model built that way has outputs or gradients that are
    exactly zero, and a comparison of zeros with zeros passes whatever the pipeline computes.

    The rule: a weight is a parameter, or a persistent buffer named `weight`, `bias` or
    `*_bias` (FrozenBatchNorm2d's affine, BART's final_logits_bias: weights that a checkpoint
    loads but training does not update). Other buffers are never filled: they are state that is
    zero or one by construction (BatchNorm running statistics and num_batches_tracked, masks,
    position ids, non-persistent constants such as a fixed zero key bias, indices filled on the
    first call), and changing them would change what the model is. A weight with some nonzero
    values (an embedding with a zero padding row) is left as it is. The values come from a
    generator of their own, in module order, so every build gives the same model.
    """
    generator = torch.Generator().manual_seed(seed)
    filled = []
    seen: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            weights = [(n, p) for n, p in module._parameters.items() if p is not None]
            weights += [(n, b) for n, b in module._buffers.items()
                        if b is not None and n not in module._non_persistent_buffers_set
                        and (n in ("weight", "bias") or n.endswith("_bias"))]
            for name, w in weights:
                if id(w) in seen:
                    continue
                seen.add(id(w))
                if w.is_floating_point() and w.numel() and not w.any():
                    w.copy_(torch.randn(w.shape, generator=generator, dtype=w.dtype) * std)
                    filled.append(f"{prefix}.{name}" if prefix else name)
    return filled


def _entry(name: str, library: str, category: str) -> Callable[[Callable[[], Built]], Callable]:
    def register(fn: Callable[[], Built]) -> Callable[[], Built]:
        def build() -> Built:
            torch.manual_seed(0)
            model, args, kwargs = fn()
            fill_zero_parameters(model)
            return model, args, kwargs

        ZOO.append(ZooEntry(name, library, category, build))
        return fn

    return register


def available() -> list[ZooEntry]:
    return [e for e in ZOO if e.installed]


def get(name: str) -> ZooEntry:
    return next(e for e in ZOO if e.name == name)


def _images(size: int = 32, channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size)


def _ids(length: int = 16, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, length))


# --- plain torch ----------------------------------------------------------------------------------

class _LSTMClassifier(nn.Module):
    """Embedding, stacked bidirectional LSTM, linear head on the final states."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.lstm = nn.LSTM(32, 32, num_layers=3, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The last layer's final state in each direction (the reverse one ends at the first
        # token); out[:, -1] would see only one step of the reverse direction, whose recurrent
        # weight would then get no gradient.
        _, (h, _) = self.lstm(self.embed(ids))
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


class _ResidualLSTMStack(nn.Module):
    """GNMT-style encoder: bidirectional LSTM layers of one shape with residual connections."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.layers = nn.ModuleList(nn.LSTM(32, 16, batch_first=True, bidirectional=True)
                                    for _ in range(3))
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)[0]
        return self.head(h)


class _CRNN(nn.Module):
    """Convolutions over a spectrogram, then a GRU over time (speech-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d((2, 1)), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.gru = nn.GRU(16 * 8, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 20)

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        h = self.conv(spec)  # (B, C, F, T)
        b, c, f, t = h.shape
        h = h.permute(0, 3, 1, 2).reshape(b, t, c * f)
        out, _ = self.gru(h)
        return self.head(out)


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(100, 32)
        self.tgt_embed = nn.Embedding(100, 32)
        self.transformer = nn.Transformer(32, 2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 100)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask)
        return self.head(h)


@_entry("torch_lstm_classifier", "torch", "LSTM")
def _torch_lstm() -> Built:
    return _LSTMClassifier(), (_ids(12),), {}


@_entry("torch_residual_lstm_stack", "torch", "LSTM")
def _torch_residual_lstm() -> Built:
    return _ResidualLSTMStack(), (_ids(10),), {}


@_entry("torch_crnn_gru", "torch", "speech / recurrent")
def _torch_crnn() -> Built:
    return _CRNN(), (torch.randn(BATCH, 1, 16, 20),), {}


@_entry("torch_transformer_seq2seq", "torch", "encoder-decoder")
def _torch_transformer() -> Built:
    return _Seq2Seq(), (_ids(10), _ids(8)), {}


# --- torchvision ----------------------------------------------------------------------------------

@_entry("tv_resnet18", "torchvision", "vision classification")
def _tv_resnet18() -> Built:
    import torchvision

    return torchvision.models.resnet18(num_classes=10), (_images(),), {}


@_entry("tv_mobilenet_v3_small", "torchvision", "vision classification")
def _tv_mobilenet() -> Built:
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0), (_images(),), {}


@_entry("tv_densenet_small", "torchvision", "vision classification")
def _tv_densenet() -> Built:
    from torchvision.models import DenseNet

    model = DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, num_classes=10)
    return model, (_images(),), {}


@_entry("tv_convnext_small_cfg", "torchvision", "ConvNeXt / EfficientNet")
def _tv_convnext() -> Built:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    setting = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(setting, stochastic_depth_prob=0.0, num_classes=10), (_images(),), {}


@_entry("tv_efficientnet_b0", "torchvision", "ConvNeXt / EfficientNet")
def _tv_efficientnet() -> Built:
    import torchvision

    model = torchvision.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.0,
                                               dropout=0.0)
    return model, (_images(),), {}


@_entry("tv_swin_small_cfg", "torchvision", "Swin / windowed attention")
def _tv_swin() -> Built:
    from torchvision.models.swin_transformer import SwinTransformer

    model = SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                            window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=10)
    return model, (_images(),), {}


@_entry("tv_vit_small_cfg", "torchvision", "vision transformer")
def _tv_vit() -> Built:
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                              hidden_dim=32, mlp_dim=64, num_classes=10)
    return model, (_images(),), {}


@_entry("tv_maxvit_small_cfg", "torchvision", "Swin / windowed attention")
def _tv_maxvit() -> Built:
    from torchvision.models.maxvit import MaxVit

    model = MaxVit(input_size=(32, 32), stem_channels=16, partition_size=4, block_channels=[16, 32],
                   block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=10)
    return model, (_images(),), {}


@_entry("tv_deeplabv3_mobilenet", "torchvision", "detection / segmentation head")
def _tv_deeplab() -> Built:
    import torchvision

    model = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4, aux_loss=False)
    return model, (_images(64),), {}


class _RetinaNetHeads(nn.Module):
    """RetinaNet's FPN backbone and heads, without the data-dependent box post-processing."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
        from torchvision.models.detection.retinanet import RetinaNetHead

        self.backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None,
                                            trainable_layers=5)
        self.head = RetinaNetHead(self.backbone.out_channels, num_anchors=9, num_classes=5)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = list(self.backbone(images).values())
        return self.head(features)


@_entry("tv_retinanet_heads", "torchvision", "detection / segmentation head")
def _tv_retinanet() -> Built:
    return _RetinaNetHeads(), (_images(64),), {}


def _video(frames: int = 4, size: int = 32) -> torch.Tensor:
    return torch.randn(BATCH, 3, frames, size, size)


@_entry("tv_swin3d_small_cfg", "torchvision", "video / windowed attention")
def _tv_swin3d() -> Built:
    # swin3d_t's blocks (3-D shifted windows, 3-D patch merging) at a small size: its builder
    # fixes the depths and widths, so the class is built directly.
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    model = SwinTransformer3d(patch_size=[2, 4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                              window_size=[2, 4, 4], stochastic_depth_prob=0.0, num_classes=10)
    return model, (_video(),), {}


@_entry("tv_mvit_v2_small_cfg", "torchvision", "video transformer")
def _tv_mvit_v2() -> Built:
    # mvit_v2_s's options (relative position bias, added in place to a view of the attention
    # scores; residual pooling; projection after attention) with two small blocks.
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    blocks = [MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
              MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2])]
    model = MViT(spatial_size=(32, 32), temporal_size=4, block_setting=blocks, residual_pool=True,
                 residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True,
                 dropout=0.0, stochastic_depth_prob=0.0, num_classes=10)
    return model, (_video(),), {}


# --- timm -----------------------------------------------------------------------------------------

def _timm(name: str, size: int = 32, **kwargs: Any) -> Built:
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=10, drop_rate=0.0, **kwargs)
    return model, (_images(size),), {}


@_entry("timm_efficientnet_b0", "timm", "ConvNeXt / EfficientNet")
def _timm_efficientnet() -> Built:
    return _timm("efficientnet_b0", drop_path_rate=0.0)


@_entry("timm_convnext_atto", "timm", "ConvNeXt / EfficientNet")
def _timm_convnext() -> Built:
    return _timm("convnext_atto", drop_path_rate=0.0)


@_entry("timm_vit_small_cfg", "timm", "vision transformer")
def _timm_vit() -> Built:
    return _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, drop_path_rate=0.0)


@_entry("timm_deit_distilled", "timm", "vision transformer")
def _timm_deit() -> Built:
    return _timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2)


@_entry("timm_swin_small_cfg", "timm", "Swin / windowed attention")
def _timm_swin() -> Built:
    return _timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                 embed_dim=16, depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0)


@_entry("timm_crossvit_small_cfg", "timm", "vision transformer")
def _timm_crossvit() -> Built:
    from timm.models.crossvit import CrossVit

    model = CrossVit(img_size=32, img_scale=(1.0, 0.75), patch_size=(8, 8), embed_dim=(16, 32),
                     depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=10,
                     drop_path_rate=0.0)
    return model, (_images(32),), {}


@_entry("timm_maxvit_small_cfg", "timm", "Swin / windowed attention")
def _timm_maxvit() -> Built:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, _rw_max_cfg

    cfg = MaxxVitCfg(embed_dim=(16, 32), depths=(1, 1), block_type=("M", "M"), stem_width=16,
                     **_rw_max_cfg(window_size=4, dim_head=8))
    return MaxxVit(cfg, img_size=32, num_classes=10, drop_path_rate=0.0), (_images(32),), {}


@_entry("timm_coatnet_small_cfg", "timm", "vision transformer")
def _timm_coatnet() -> Built:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, _rw_coat_cfg

    cfg = MaxxVitCfg(embed_dim=(16, 32, 64), depths=(1, 1, 1), block_type=("C", "C", "T"),
                     stem_width=16, **_rw_coat_cfg(conv_attn_early=True))
    return MaxxVit(cfg, img_size=32, num_classes=10, drop_path_rate=0.0), (_images(32),), {}


@_entry("timm_dpn_small_cfg", "timm", "vision classification")
def _timm_dpn() -> Built:
    from timm.models.dpn import DPN

    model = DPN(k_sec=(1, 1, 1, 1), inc_sec=(8, 8, 8, 8), k_r=16, groups=4, num_init_features=16,
                small=True, num_classes=10)
    return model, (_images(32),), {}


@_entry("timm_mixer_small_cfg", "timm", "vision classification")
def _timm_mixer() -> Built:
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)
    return model, (_images(32),), {}


@_entry("timm_mobilevit_xxs", "timm", "vision transformer")
def _timm_mobilevit() -> Built:
    return _timm("mobilevit_xxs", size=64)


@_entry("timm_levit_small_cfg", "timm", "vision transformer")
def _timm_levit() -> Built:
    from timm.models.levit import Levit

    model = Levit(img_size=64, embed_dim=(32, 48), key_dim=8, depth=(1, 1), num_heads=(2, 2),
                  num_classes=10)
    return model, (_images(64),), {}


@_entry("timm_volo_small_cfg", "timm", "vision transformer")
def _timm_volo() -> Built:
    # volo_d1_224's layout (outlooker stage, then transformer stages, class-attention post
    # layers, token-labelling aux head) at a small size; volo_d1_224 fixes its layers and widths.
    from timm.models.volo import VOLO

    model = VOLO(layers=(1, 1, 1, 1), img_size=32, num_classes=10, stem_hidden_dim=16,
                 embed_dims=(32, 64, 64, 64), num_heads=(2, 4, 4, 4), drop_path_rate=0.0)
    return model, (_images(32),), {}


@_entry("timm_convit_small_cfg", "timm", "vision transformer")
def _timm_convit() -> Built:
    # Its gated positional self-attention fills its rel_indices buffer on the first call.
    return _timm("convit_tiny", img_size=32, patch_size=8, depth=2, local_up_to_layer=1,
                 embed_dim=8, num_heads=4, drop_path_rate=0.0)


# --- segmentation-models-pytorch ------------------------------------------------------------------

@_entry("smp_unet_resnet18", "segmentation_models_pytorch", "detection / segmentation head")
def _smp_unet() -> Built:
    import segmentation_models_pytorch as smp

    model = smp.Unet("resnet18", encoder_weights=None, classes=3,
                     decoder_channels=(64, 32, 16, 8, 8))
    return model, (_images(64),), {}


@_entry("smp_segformer_mit_b0", "segmentation_models_pytorch", "detection / segmentation head")
def _smp_segformer() -> Built:
    import segmentation_models_pytorch as smp

    model = smp.Segformer("mit_b0", encoder_weights=None, classes=3)
    return model, (_images(64),), {}


# --- MONAI ----------------------------------------------------------------------------------------

@_entry("monai_unet", "monai", "detection / segmentation head")
def _monai_unet() -> Built:
    from monai.networks.nets import UNet

    model = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32),
                 strides=(2, 2), num_res_units=1)
    return model, (_images(32, 1),), {}


@_entry("monai_swin_unetr", "monai", "Swin / windowed attention")
def _monai_swin_unetr() -> Built:
    from monai.networks.nets import SwinUNETR

    model = SwinUNETR(in_channels=1, out_channels=2, spatial_dims=2, feature_size=12,
                      depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4,
                      drop_rate=0.0, attn_drop_rate=0.0, dropout_path_rate=0.0)
    return model, (_images(64, 1),), {}


@_entry("monai_unetr", "monai", "vision transformer")
def _monai_unetr() -> Built:
    from monai.networks.nets import UNETR

    model = UNETR(in_channels=1, out_channels=2, img_size=(32, 32), spatial_dims=2,
                  feature_size=8, hidden_size=32, mlp_dim=64, num_heads=2, dropout_rate=0.0)
    return model, (_images(32, 1),), {}


@_entry("monai_dynunet_deep_supervision", "monai", "detection / segmentation head")
def _monai_dynunet() -> Built:
    # In training mode its decoder stores the deep-supervision heads in a Python list as it
    # runs, and forward stacks them with the output; in eval mode it returns the output alone.
    from monai.networks.nets import DynUNet

    model = DynUNet(spatial_dims=2, in_channels=1, out_channels=2, kernel_size=[3, 3, 3],
                    strides=[1, 2, 2], upsample_kernel_size=[2, 2], filters=[8, 16, 32],
                    deep_supervision=True, deep_supr_num=1)
    return model, (_images(32, 1),), {}


# --- diffusers ------------------------------------------------------------------------------------

@_entry("diffusers_unet2d", "diffusers", "diffusion UNet")
def _diffusers_unet2d() -> Built:
    from diffusers import UNet2DModel

    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)
    return model, (_images(16), 10), {}  # one timestep for the whole batch, as samplers do


@_entry("diffusers_unet2d_condition", "diffusers", "diffusion UNet")
def _diffusers_unet2d_condition() -> Built:
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    timestep = torch.tensor([10, 20, 30, 40])
    return model, (_images(16, 4), timestep), {"encoder_hidden_states": torch.randn(BATCH, 8, 32)}


def _autoencoder_kl() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
                         block_out_channels=(16, 32), layers_per_block=1, sample_size=32,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2)


@_entry("diffusers_vae_kl", "diffusers", "VAE")
def _diffusers_vae() -> Built:
    return _autoencoder_kl(), (_images(32),), {}


class _VAEDecode(nn.Module):
    """What a latent-diffusion pipeline runs last: latents to images."""

    def __init__(self) -> None:
        super().__init__()
        self.vae = _autoencoder_kl()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents).sample


@_entry("diffusers_vae_decoder", "diffusers", "VAE")
def _diffusers_vae_decoder() -> Built:
    return _VAEDecode(), (torch.randn(BATCH, 4, 16, 16),), {}


@_entry("diffusers_dit", "diffusers", "diffusion transformer")
def _diffusers_dit() -> Built:
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  num_layers=2, sample_size=8, patch_size=2, norm_num_groups=8,
                                  num_embeds_ada_norm=100)
    labels = torch.tensor([1, 2, 3, 4])
    return model, (torch.randn(BATCH, 4, 8, 8),), {"timestep": torch.tensor([5, 6, 7, 8]),
                                                   "class_labels": labels}


@_entry("diffusers_cogvideox", "diffusers", "video diffusion transformer")
def _diffusers_cogvideox() -> Built:
    from diffusers import CogVideoXTransformer3DModel

    # 5 frames are 2 latent frames at its temporal compression of 4: 2 x 4 x 4 patches.
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                        out_channels=4, time_embed_dim=16, text_embed_dim=16,
                                        num_layers=2, sample_width=8, sample_height=8,
                                        sample_frames=5, patch_size=2, max_text_seq_length=8)
    latents, text = torch.randn(BATCH, 2, 4, 8, 8), torch.randn(BATCH, 8, 16)
    return model, (latents, text, torch.tensor([5, 6, 7, 8])), {}


# --- transformers ---------------------------------------------------------------------------------

_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@_entry("hf_bert", "transformers", "encoder")
def _hf_bert() -> Built:
    import transformers as tr

    cfg = tr.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, **_NO_DROPOUT)
    return tr.BertForSequenceClassification(cfg), (_ids(),), {}


@_entry("hf_gpt2", "transformers", "decoder-only")
def _hf_gpt2() -> Built:
    import transformers as tr

    cfg = tr.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    return tr.GPT2LMHeadModel(cfg), (_ids(),), {"use_cache": False}


def _decoder_kwargs() -> dict[str, Any]:
    return {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64}


@_entry("hf_llama", "transformers", "decoder-only")
def _hf_llama() -> Built:
    import transformers as tr

    return tr.LlamaForCausalLM(tr.LlamaConfig(**_decoder_kwargs())), (_ids(),), {"use_cache": False}


@_entry("hf_mixtral_moe", "transformers", "decoder-only MoE")
def _hf_mixtral() -> Built:
    import transformers as tr

    cfg = tr.MixtralConfig(**_decoder_kwargs(), num_local_experts=4, num_experts_per_tok=2)
    return tr.MixtralForCausalLM(cfg), (_ids(),), {"use_cache": False}


@_entry("hf_qwen2_moe", "transformers", "decoder-only MoE")
def _hf_qwen2_moe() -> Built:
    import transformers as tr

    cfg = tr.Qwen2MoeConfig(**_decoder_kwargs(), moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2)
    return tr.Qwen2MoeForCausalLM(cfg), (_ids(),), {"use_cache": False}


@_entry("hf_t5", "transformers", "encoder-decoder")
def _hf_t5() -> Built:
    import transformers as tr

    cfg = tr.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0)
    return tr.T5ForConditionalGeneration(cfg), (_ids(),), {"decoder_input_ids": _ids(8),
                                                           "use_cache": False}


@_entry("hf_bart", "transformers", "encoder-decoder")
def _hf_bart() -> Built:
    import transformers as tr

    cfg = tr.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0)
    return tr.BartForConditionalGeneration(cfg), (_ids(),), {"decoder_input_ids": _ids(8),
                                                             "use_cache": False}


@_entry("hf_switch_moe", "transformers", "encoder-decoder MoE")
def _hf_switch() -> Built:
    import transformers as tr

    cfg = tr.SwitchTransformersConfig(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                      num_decoder_layers=2, num_heads=4, num_experts=4,
                                      encoder_sparse_step=1, decoder_sparse_step=1,
                                      dropout_rate=0.0, router_jitter_noise=0.0,
                                      expert_capacity=64, decoder_start_token_id=0)
    model = tr.SwitchTransformersForConditionalGeneration(cfg)
    ids = _ids()
    # The mask is given: without it the encoder indexes None under torch.export (transformers
    # builds the default mask only outside of compilation).
    return model, (ids,), {"attention_mask": torch.ones_like(ids), "decoder_input_ids": _ids(8),
                           "use_cache": False}


@_entry("hf_whisper", "transformers", "speech")
def _hf_whisper() -> Built:
    import transformers as tr

    cfg = tr.WhisperConfig(vocab_size=100, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                           d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                           max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, decoder_start_token_id=0, pad_token_id=0)
    features = torch.randn(BATCH, 16, 32)
    return tr.WhisperModel(cfg), (features,), {"decoder_input_ids": _ids(8), "use_cache": False}


def _speech_kwargs() -> dict[str, Any]:
    return {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "conv_dim": (16, 16), "conv_stride": (5, 2),
            "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "activation_dropout": 0.0, "feat_proj_dropout": 0.0, "layerdrop": 0.0,
            "mask_time_prob": 0.0, "mask_feature_prob": 0.0, "vocab_size": 32}


@_entry("hf_wav2vec2_ctc", "transformers", "speech")
def _hf_wav2vec2() -> Built:
    import transformers as tr

    model = tr.Wav2Vec2ForCTC(tr.Wav2Vec2Config(**_speech_kwargs(), final_dropout=0.0))
    return model, (torch.randn(BATCH, 800),), {}


@_entry("hf_hubert", "transformers", "speech")
def _hf_hubert() -> Built:
    import transformers as tr

    return tr.HubertModel(tr.HubertConfig(**_speech_kwargs())), (torch.randn(BATCH, 800),), {}


@_entry("hf_vit", "transformers", "vision transformer")
def _hf_vit() -> Built:
    import transformers as tr

    cfg = tr.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=10, **_NO_DROPOUT)
    return tr.ViTForImageClassification(cfg), (_images(),), {}


@_entry("hf_swin", "transformers", "Swin / windowed attention")
def _hf_swin() -> Built:
    import transformers as tr

    cfg = tr.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                        num_heads=[1, 2], window_size=4, num_labels=10, drop_path_rate=0.0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tr.SwinForImageClassification(cfg), (_images(),), {}


@_entry("hf_segformer", "transformers", "detection / segmentation head")
def _hf_segformer() -> Built:
    import transformers as tr

    cfg = tr.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                             hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                             num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=32, num_labels=4, drop_path_rate=0.0,
                             **_NO_DROPOUT, classifier_dropout_prob=0.0)
    return tr.SegformerForSemanticSegmentation(cfg), (_images(32),), {}


@_entry("hf_speech2text", "transformers", "speech")
def _hf_speech2text() -> Built:
    # Its sinusoidal position embedding runs under torch.no_grad() inside forward.
    import transformers as tr

    cfg = tr.Speech2TextConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=2, decoder_attention_heads=2,
                               encoder_ffn_dim=64, decoder_ffn_dim=64, conv_channels=32,
                               input_feat_per_channel=16, max_source_positions=64,
                               max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                               activation_dropout=0.0)
    features = torch.randn(BATCH, 32, 16)  # (batch, frames, features per frame)
    return tr.Speech2TextForConditionalGeneration(cfg), (features,), {
        "decoder_input_ids": _ids(8), "use_cache": False}


@_entry("hf_llava", "transformers", "vision-language")
def _hf_llava() -> Built:
    import transformers as tr

    vision = tr.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, image_size=32, patch_size=8)
    cfg = tr.LlavaConfig(vision_config=vision, text_config=tr.LlamaConfig(**_decoder_kwargs()),
                         image_token_index=99, image_seq_length=16)
    # Each prompt holds one image: 16 image tokens (4 x 4 patches, the class token dropped).
    ids = torch.randint(0, 90, (BATCH, 24))
    ids[:, 2:18] = 99
    return tr.LlavaForConditionalGeneration(cfg), (ids,), {"pixel_values": _images(32),
                                                           "use_cache": False}


@_entry("hf_rwkv", "transformers", "recurrent LM")
def _hf_rwkv() -> Built:
    import transformers as tr

    cfg = tr.RwkvConfig(vocab_size=100, context_length=16, hidden_size=32, num_hidden_layers=2,
                        attention_hidden_size=32, intermediate_size=64)
    return tr.RwkvForCausalLM(cfg), (_ids(),), {"use_cache": False}


@_entry("hf_detr", "transformers", "detection / segmentation head")
def _hf_detr() -> Built:
    # A small ResNet backbone from its config (random weights, no timm, nothing downloaded).
    import transformers as tr

    backbone = tr.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                               layer_type="basic", out_features=["stage2"])
    cfg = tr.DetrConfig(backbone_config=backbone, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, num_queries=8, num_labels=5, dropout=0.0)
    return tr.DetrForObjectDetection(cfg), (_images(64),), {}
