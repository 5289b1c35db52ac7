"""Spec -> module: the decoder, its loss, the MTP modules, and the recipes that name specs."""

from zoo.model.decoder import CausalLMOutput, Decoder, build_model
from zoo.model.loss import LossOutput, lm_loss

__all__ = ["CausalLMOutput", "Decoder", "LossOutput", "build_model", "lm_loss"]
