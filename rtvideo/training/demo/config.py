"""The demo model's training configuration: what ``rtvideo train-demo`` trains.

Torch side, training only (read by ``train``; the UMT5 config needs ``transformers``). One
``TrainConfig`` per run, recorded in ``OUT/train.json`` and checked against a
resumed run's; ``TINY`` is the seconds-long configuration the tests train.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import UMT5Config


@dataclass(frozen=True)
class TrainConfig:
    """What a run trains; a resumed run must have the same (``train.json``)."""

    size: int = 64  # frame width and height, pixels
    chunks: int = 6  # chunks per training clip
    window_chunks: int = 3  # clean chunks a chunk attends to (the served cache's rolling window, no sinks)
    self_context: float = 0.5  # clips whose attended chunks are the model's own denoised ones
    batch: int = 16
    lr: float = 5e-4
    warmup_steps: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    switch_probability: float = 0.35  # clips whose caption switches at a chunk boundary
    stream_start_probability: float = 0.35  # clips that begin a stream (canonical start)
    schedule_probability: float = 0.75  # noise levels from the 4-step serving schedule; else shifted uniform
    codec_fit_clips: int = 256
    latent_channels: int = 16
    text_length: int = 32  # tokens per caption (ByT5 bytes + EOS; the longest caption is 31)
    layers: int = 4
    dim: int = 128
    heads: int = 4
    ffn: int = 512
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_ff: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.window_chunks < self.chunks:
            raise ValueError(f"window_chunks must be in 1..chunks-1, got {self.window_chunks} for {self.chunks}")
        if not 0.0 <= self.self_context <= 1.0:
            raise ValueError(f"self_context must be in [0, 1], got {self.self_context}")

    def transformer_config(self) -> dict:
        return dict(
            patch_size=(1, 2, 2),
            num_attention_heads=self.heads,
            attention_head_dim=self.dim // self.heads,
            in_channels=self.latent_channels,
            out_channels=self.latent_channels,
            text_dim=self.text_dim,
            freq_dim=64,
            ffn_dim=self.ffn,
            num_layers=self.layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            image_dim=None,
            added_kv_proj_dim=None,
            rope_max_seq_len=1024,
        )

    def text_config(self) -> UMT5Config:
        return UMT5Config(
            vocab_size=384,
            d_model=self.text_dim,
            d_kv=self.text_dim // self.text_heads,
            d_ff=self.text_ff,
            num_layers=self.text_layers,
            num_heads=self.text_heads,
            relative_attention_num_buckets=16,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
        )


# What a ``train.json`` written before a field existed meant by it (the recipe then).
BEFORE_FIELD = {"window_chunks": 3, "self_context": 0.0}

# A configuration small enough to train a few steps in seconds (tests).
TINY = TrainConfig(
    size=32,
    chunks=2,
    window_chunks=1,
    batch=2,
    codec_fit_clips=8,
    layers=1,
    dim=24,
    heads=2,
    ffn=48,
    text_dim=16,
    text_ff=32,
)
